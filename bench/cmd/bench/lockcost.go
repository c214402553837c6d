package main

// Redis CPU per uncontended locked request, for the README's "Scaling out"
// estimate: clients closed-loop on distinct keys through a `redis_lock` +
// `respond` site, the CPU of every redis-server behind it from INFO cpu.

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

type lockCostRow struct {
	name     string
	reqs     int64
	dur      time.Duration
	redisCPU float64 // seconds, per server (the mean over the servers)
	err      error
}

func runLockCost(name, base string, servers []*redisProc, clients int, measure time.Duration) lockCostRow {
	row := lockCostRow{name: name}
	tag := strconv.FormatInt(time.Now().UnixNano()%1e6, 36)
	do := func(c, i int) error {
		code, err := get(context.Background(), fmt.Sprintf("%s/fast/cost-%s-%d-%d", base, tag, c, i), nil)
		if err == nil && code != 200 {
			err = fmt.Errorf("status %d", code)
		}
		return err
	}
	loopFor(clients, 300*time.Millisecond, do)
	var infoClients []*redis.Client
	for _, r := range servers {
		c := redis.NewClient(&redis.Options{Addr: r.addr(), PoolSize: 1})
		defer c.Close()
		infoClients = append(infoClients, c)
	}
	cpu := func() float64 {
		var s float64
		for _, c := range infoClients {
			s += redisCPU(c)
		}
		return s / float64(len(servers))
	}
	c0, t0 := cpu(), time.Now()
	row.reqs, row.err = loopFor(clients, measure, do)
	row.redisCPU, row.dur = cpu()-c0, time.Since(t0)
	return row
}

func printLockCost(p func(string, ...any), rows []lockCostRow, clients int) {
	p("#### Redis CPU per uncontended locked request (%d clients, distinct keys, `redis_lock` + `respond`)", clients)
	p("")
	p("| config | requests/s | Redis CPU per request, each server |")
	p("|---|---|---|")
	for _, r := range rows {
		if r.err != nil || r.reqs == 0 {
			p("| %s | — | error: %v |", r.name, r.err)
			continue
		}
		p("| %s | %.0f | %.1f µs |", r.name, float64(r.reqs)/r.dur.Seconds(), r.redisCPU/float64(r.reqs)*1e6)
	}
	p("")
}

// loopFor runs clients goroutines, each calling do(client, i) again as soon
// as the last call returned, for d; it returns the calls that succeeded and
// the first error (a goroutine stops at its first error).
func loopFor(clients int, d time.Duration, do func(c, i int) error) (int64, error) {
	stop := time.Now().Add(d)
	var ok atomic.Int64
	var firstErr atomic.Pointer[error]
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			for i := 0; time.Now().Before(stop); i++ {
				if err := do(c, i); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
				ok.Add(1)
			}
		}(c)
	}
	wg.Wait()
	if e := firstErr.Load(); e != nil {
		return ok.Load(), *e
	}
	return ok.Load(), nil
}

package main

// The rate-limit peers at library level: the same closed loop
// (64 goroutines over 1000 keys, no HTTP) against one redis-server, once
// through go-redis/redis_rate (GCRA, one EVALSHA per decision) and once as
// an Envoy-style fixed window (INCRBY + EXPIRE in one pipeline per
// decision). What matters is Redis CPU per decision (the INFO cpu delta),
// the unit that caps a whole fleet.

import (
	"context"
	"fmt"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
)

type peerRow struct {
	name      string
	decisions int64
	dur       time.Duration
	redisCPU  float64 // seconds
	err       error
}

// runRateLimitPeers measures each peer for measure after a short warm-up.
func runRateLimitPeers(step func(string, ...any), clients, keys int, measure time.Duration) []peerRow {
	r, err := startRedis("redisPeers")
	if err != nil {
		return []peerRow{{name: "peers", err: err}}
	}
	rc := redis.NewClient(&redis.Options{Addr: r.addr(), PoolSize: clients})
	defer rc.Close()
	limiter := redis_rate.NewLimiter(rc)
	peers := []struct {
		name   string
		decide func(ctx context.Context, key string) error
	}{
		{"go-redis/redis_rate v10 GCRA (one EVALSHA)", func(ctx context.Context, key string) error {
			_, err := limiter.Allow(ctx, key, redis_rate.PerSecond(1000000))
			return err
		}},
		{"Envoy-style fixed window (INCRBY + EXPIRE, one pipeline)", func(ctx context.Context, key string) error {
			_, err := rc.Pipelined(ctx, func(p redis.Pipeliner) error {
				p.IncrBy(ctx, key, 1)
				p.Expire(ctx, key, time.Second)
				return nil
			})
			return err
		}},
	}
	var rows []peerRow
	for _, pr := range peers {
		step("rate limit peers: %s, %d goroutines over %d keys, %s", pr.name, clients, keys, measure)
		row := peerRow{name: pr.name}
		do := func(c, i int) error { return pr.decide(context.Background(), fmt.Sprintf("peer:%d", (c*7919+i)%keys)) }
		loopFor(clients, 300*time.Millisecond, do)
		c0, t0 := redisCPU(rc), time.Now()
		row.decisions, row.err = loopFor(clients, measure, do)
		row.redisCPU, row.dur = redisCPU(rc)-c0, time.Since(t0)
		rows = append(rows, row)
	}
	return rows
}

func printRateLimitPeers(p func(string, ...any), rows []peerRow, clients, keys int) {
	p("#### Rate-limit peers at library level (%d goroutines over %d keys, no HTTP, one redis-server)", clients, keys)
	p("")
	p("| peer | decisions/s | Redis CPU per decision |")
	p("|---|---|---|")
	for _, r := range rows {
		if r.err != nil || r.decisions == 0 {
			p("| %s | — | error: %v |", r.name, r.err)
			continue
		}
		p("| %s | %.0f | %.1f µs |", r.name, float64(r.decisions)/r.dur.Seconds(), r.redisCPU/float64(r.decisions)*1e6)
	}
	p("")
	p("- Redis CPU = the `INFO cpu` delta (used_cpu_user + used_cpu_sys) over the measured part ÷ decisions. `redis_ratelimit`'s own figure is the Redis column of the throughput table above (through Caddy, %d clients).", *rlClients)
	p("")
}

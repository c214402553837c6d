package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// replayResult is the execute-once figure: n identical requests at once
// over two Caddy instances sharing one Redis, with `replay`.
type replayResult struct {
	requests, calls int64
	ok, replayed    int64
	all             time.Duration // until every request was answered
	err             error
}

// runReplay starts one redis-server, an upstream that counts its calls
// (each takes 50 ms) and two Caddy instances with a replayed idempotent
// POST, and sends n identical requests at once, alternating between them.
func runReplay(step func(string, ...any), n int) replayResult {
	step("replay: %d identical POSTs at once over two Caddy instances", n)
	var res replayResult
	r, err := startRedis("redisReplay")
	if err != nil {
		return replayResult{err: err}
	}
	var calls atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		calls.Add(1)
		_, _ = io.Copy(io.Discard, req.Body)
		time.Sleep(50 * time.Millisecond)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"order":1}`)
	}))
	defer up.Close()
	site := func(port int) string {
		return fmt.Sprintf(`
http://127.0.0.1:%d {
	redis_lock {
		key {http.request.header.X-User}:{http.request.header.Idempotency-Key}
		replay 1m
		redis %s
	}
	reverse_proxy %s
}
`, port, r.addr(), strings.TrimPrefix(up.URL, "http://"))
	}
	var urls []string
	for _, name := range []string{"replayA", "replayB"} {
		port, err := freePort()
		if err != nil {
			return replayResult{err: err}
		}
		if _, err := startCaddy(name, globalOpts(name)+site(port), port); err != nil {
			return replayResult{err: err}
		}
		urls = append(urls, fmt.Sprintf("http://127.0.0.1:%d/orders", port))
	}
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			req, _ := http.NewRequest("POST", urls[i%2], strings.NewReader(`{"sku":"42"}`))
			req.Header.Set("X-User", "alice")
			req.Header.Set("Idempotency-Key", "bench-1")
			resp, err := client.Do(req)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusCreated {
				atomic.AddInt64(&res.ok, 1)
			}
			if resp.Header.Get("Idempotent-Replayed") == "true" {
				atomic.AddInt64(&res.replayed, 1)
			}
		}(i)
	}
	wg.Wait()
	res.all = time.Since(start)
	res.requests, res.calls = int64(n), calls.Load()
	return res
}

// printReplay prints the execute-once table.
func printReplay(p func(string, ...any), r replayResult) {
	p("")
	p("**Execute once** (`replay`): identical POSTs (same user and Idempotency-Key) sent at once, alternating between two Caddy instances on one Redis; the upstream takes 50 ms.")
	p("")
	p("| requests | upstream calls | goal | answered 201 | of them replayed | all answered after |")
	p("|---|---|---|---|---|---|")
	if r.err != nil {
		p("| — | — | = 1 | — | — | error: %s |", oneLine(r.err))
		return
	}
	p("| %d | **%d** | = 1 %s | %d | %d | %s |", r.requests, r.calls, check(r.calls == 1), r.ok, r.replayed, ms(r.all))
}

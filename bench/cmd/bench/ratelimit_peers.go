package main

// The rate-limit peers at library level: the same closed loop
// (64 goroutines over 1000 keys, no HTTP) against one redis-server, through
// go-redis/redis_rate (GCRA, one EVALSHA per decision), as an Envoy-style
// fixed window (INCRBY + EXPIRE in one pipeline per decision), and through
// redis_ratelimit's own handler (its ServeHTTP, so its batching, with no
// HTTP server around it). What matters is Redis CPU per decision (the INFO
// cpu delta), the unit that caps a whole fleet.

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"github.com/caddy-dlm/redisdlm/redisratelimit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
)

type peerRow struct {
	name      string
	decisions int64
	dur       time.Duration
	redisCPU  float64 // seconds
	goCPU     float64 // seconds of this (the client's) process
	scripts   int64   // script calls (EVALSHA, EVAL) in the measured part
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
	type peer struct {
		name   string
		decide func(ctx context.Context, key string) error
		per    int // decisions per call of decide (default 1)
	}
	peers := []peer{
		{name: "go-redis/redis_rate v10 GCRA (one EVALSHA)", decide: func(ctx context.Context, key string) error {
			_, err := limiter.Allow(ctx, key, redis_rate.PerSecond(1000000))
			return err
		}},
		{name: "Envoy-style fixed window (INCRBY + EXPIRE, one pipeline)", decide: func(ctx context.Context, key string) error {
			_, err := rc.Pipelined(ctx, func(p redis.Pipeliner) error {
				p.IncrBy(ctx, key, 1)
				p.Expire(ctx, key, time.Second)
				return nil
			})
			return err
		}},
		// What any limiter that is exact across instances must at least do
		// per decision: read its key and write it back with an expiry, here
		// as native commands, 32 decisions per pipeline (no script, no
		// logic): a floor for Redis CPU per decision on this machine.
		{name: "floor: GET + SET PX per decision, native, 32 decisions per pipeline", per: 32, decide: func(ctx context.Context, key string) error {
			_, err := rc.Pipelined(ctx, func(p redis.Pipeliner) error {
				for j := 0; j < 32; j++ {
					k := fmt.Sprintf("%s:%d", key, j)
					p.Get(ctx, k)
					p.Set(ctx, k, "1764590400123456", time.Second)
				}
				return nil
			})
			if err == redis.Nil {
				err = nil
			}
			return err
		}},
		// The same inside one script call per 32 decisions: what running
		// the decisions in Lua costs before any of their logic.
		{name: "floor in a script: GET + SET PX per decision, 32 decisions per EVALSHA", per: 32, decide: func(ctx context.Context, key string) error {
			keys := make([]string, 32)
			for j := range keys {
				keys[j] = fmt.Sprintf("%s:%d", key, j)
			}
			return floorScript.Run(ctx, rc, keys).Err()
		}},
	}
	fb, stopFloor := newFloorBatcher(rc)
	defer stopFloor()
	peers = append(peers, peer{name: "floor, client side: each decision handed to one worker (channel), native GET + SET PX, one pipeline per batch", decide: func(ctx context.Context, key string) error {
		return fb.decide(key)
	}})
	for _, algo := range []string{"gcra", "sliding_window"} {
		n := 1000000 // the largest each algorithm takes per second: nothing is rejected
		if algo == "sliding_window" {
			n = 100000
		}
		h, stop, err := provisionRateLimit(r.addr(), algo, n)
		if err != nil {
			return []peerRow{{name: "redis_ratelimit", err: err}}
		}
		defer stop()
		peers = append(peers, peer{name: fmt.Sprintf("redisdlm `redis_ratelimit` %s (its handler, batched; no HTTP)", algo), decide: func(ctx context.Context, key string) error {
			return serveOnce(h, key)
		}})
	}
	// What the two rows above spend outside the handler: the request, its
	// replacer and recorder, built as Caddy would hand them over.
	peers = append(peers, peer{name: "the same loop without a limiter (the request as Caddy hands it over; no Redis)", decide: func(ctx context.Context, key string) error {
		return serveOnce(nil, key)
	}})
	var rows []peerRow
	for _, pr := range peers {
		step("rate limit peers: %s, %d goroutines over %d keys, %s", pr.name, clients, keys, measure)
		row := peerRow{name: pr.name}
		do := func(c, i int) error { return pr.decide(context.Background(), fmt.Sprintf("peer:%d", (c*7919+i)%keys)) }
		loopFor(clients, 300*time.Millisecond, do)
		s0, _ := scriptCalls(rc)
		c0, g0, t0 := redisCPU(rc), cpuSeconds(os.Getpid()), time.Now()
		row.decisions, row.err = loopFor(clients, measure, do)
		row.decisions *= int64(max(pr.per, 1))
		row.redisCPU, row.goCPU, row.dur = redisCPU(rc)-c0, cpuSeconds(os.Getpid())-g0, time.Since(t0)
		s1, _ := scriptCalls(rc)
		row.scripts = s1 - s0
		rows = append(rows, row)
	}
	return rows
}

func printRateLimitPeers(p func(string, ...any), rows []peerRow, clients, keys int) {
	p("#### Rate-limit peers at library level (%d goroutines over %d keys, no HTTP, one redis-server)", clients, keys)
	p("")
	p("| peer | decisions/s | decisions per script call | Redis CPU per decision | client CPU per decision |")
	p("|---|---|---|---|---|")
	for _, r := range rows {
		if r.err != nil || r.decisions == 0 {
			p("| %s | — | — | error: %v | — |", r.name, r.err)
			continue
		}
		per := "— (no script)"
		if r.scripts > 0 {
			per = fmt.Sprintf("%.1f", float64(r.decisions)/float64(r.scripts))
		}
		p("| %s | %.0f | %s | %.1f µs | %.1f µs |", r.name, float64(r.decisions)/r.dur.Seconds(), per,
			r.redisCPU/float64(r.decisions)*1e6, r.goCPU/float64(r.decisions)*1e6)
	}
	p("")
	p("- Redis CPU = the `INFO cpu` delta (used_cpu_user + used_cpu_sys) over the measured part ÷ decisions. The `redis_ratelimit` rows run its handler's ServeHTTP in the same loop (the requests of one client are batched into one pipeline and one script call, as in Caddy); the Redis column of the throughput table above is the same figure through Caddy (%d HTTP clients, Caddy and the load generator on the same 2 cores). Client CPU is this process's (go-redis, the limiter, the loop) from /proc in 10 ms ticks; the loop's own cost is the row without a limiter.", *rlClients)
	p("")
}

// floorScript reads and writes back (with an expiry) each of its keys.
var floorScript = redis.NewScript(`
for i = 1, #KEYS do
	redis.call('GET', KEYS[i])
	redis.call('SET', KEYS[i], '1764590400123456', 'PX', '1000')
end
return 1
`)

// provisionRateLimit makes a redis_ratelimit handler keyed by the X-Key
// header, with rate n per second, outside any Caddy server.
func provisionRateLimit(addr, algo string, n int) (*redisratelimit.RedisRateLimit, func(), error) {
	h := &redisratelimit.RedisRateLimit{
		Key:       "{http.request.header.X-Key}",
		Rates:     []redisratelimit.Rate{{Requests: n, Window: caddy.Duration(time.Second)}},
		Algorithm: algo,
	}
	h.Addresses = []string{addr}
	// A loaded (empty) config, so the handler logs at ERROR level as in the
	// Caddy process, not through a development logger at DEBUG.
	if err := caddy.Load([]byte(`{"admin":{"disabled":true},"logging":{"logs":{"default":{"level":"ERROR"}}}}`), false); err != nil {
		return nil, nil, err
	}
	ctx, cancel := caddy.NewContext(caddy.ActiveContext())
	if err := h.Provision(ctx); err != nil {
		cancel()
		return nil, nil, err
	}
	if err := h.Validate(); err != nil {
		cancel()
		return nil, nil, err
	}
	return h, func() { _ = h.Cleanup(); cancel() }, nil
}

var okNext = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil })

// serveOnce runs one request with key through h, as Caddy would hand it
// over; with h nil, straight to the next handler.
func serveOnce(h *redisratelimit.RedisRateLimit, key string) error {
	req := httptest.NewRequest(http.MethodGet, "http://bench/", nil)
	req.Header.Set("X-Key", key)
	repl := caddyhttp.NewTestReplacer(req)
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
	w := httptest.NewRecorder()
	if h == nil {
		return okNext.ServeHTTP(w, req)
	}
	if err := h.ServeHTTP(w, req, okNext); err != nil {
		return err
	}
	if w.Header().Get("RateLimit") == "" {
		return fmt.Errorf("answer without a RateLimit field: not decided by Redis")
	}
	return nil
}

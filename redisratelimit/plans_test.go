package redisratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Plans (placeholder rates), cost, count and wait.

// rateOf is a rate from its Caddyfile arguments.
func rateOf(t testing.TB, n, window string) Rate {
	t.Helper()
	r, err := RateOf(n, window)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// plan sets the {plan_rpm} placeholder the way `map` does (a lazy lookup
// through the replacer).
func withPlan(rpm string) func(*http.Request, *caddy.Replacer) {
	return func(r *http.Request, repl *caddy.Replacer) {
		repl.Map(func(key string) (any, bool) {
			if key == "plan_rpm" {
				return rpm, true
			}
			return nil, false
		})
	}
}

// TestRateLimitPlanExactTwoInstances: a rate whose n comes from a `map`
// placeholder gives each plan its own exact limit over two instances, its
// own Redis key and its own RateLimit-Policy entry.
func TestRateLimitPlanExactTwoInstances(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	mk := func(timeout time.Duration) *RedisRateLimit {
		return newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Key = "{http.request.header.X-User}"
			h.Rates = []Rate{rateOf(t, "{plan_rpm}", "1m"), rateOf(t, "1000", "1h")}
			h.Timeout = caddy.Duration(timeout) // separate clients, as two instances
		})
	}
	hs := []*RedisRateLimit{mk(3 * time.Second), mk(3100 * time.Millisecond)}
	for _, tc := range []struct {
		user, rpm string
		want      int
	}{{"pro-user", "7", 7}, {"free-user", "3", 3}} {
		var admitted atomic.Int64
		var policy sync.Map
		var wg sync.WaitGroup
		for i := 0; i < 30; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				a := serveRL(hs[i%2], "192.0.2.70", func(req *http.Request, repl *caddy.Replacer) {
					req.Header.Set("X-User", tc.user)
					withPlan(tc.rpm)(req, repl)
				})
				if a.passed {
					admitted.Add(1)
				} else if a.status != 429 {
					t.Errorf("%s: status %d err %v", tc.user, a.status, a.err)
				}
				policy.Store(a.header.Get(HeaderRateLimitPolicy), true)
			}(i)
		}
		wg.Wait()
		if got := admitted.Load(); got != int64(tc.want) {
			t.Fatalf("%s on plan %s: %d admitted, want exactly %d", tc.user, tc.rpm, got, tc.want)
		}
		want := fmt.Sprintf(`"r0";q=%s;w=60, "r1";q=1000;w=3600`, tc.rpm)
		policy.Range(func(k, _ any) bool {
			if k.(string) != want {
				t.Errorf("%s: RateLimit-Policy %q, want %q", tc.user, k, want)
			}
			return true
		})
		if n := rlRingCount(t, r, "caddy:rl:{"+tc.user+"}:sw:"+tc.rpm+"/1m0s"); n != tc.want {
			t.Fatalf("%s: the plan's key holds %d admissions, want %d", tc.user, n, tc.want)
		}
	}
	// A plan change is a new state: the user upgraded gets the pro quota.
	if a := serveRL(hs[0], "192.0.2.70", func(req *http.Request, repl *caddy.Replacer) {
		req.Header.Set("X-User", "free-user")
		withPlan("7")(req, repl)
	}); !a.passed {
		t.Fatalf("upgraded user rejected: %d (a deny of one plan must not answer another)", a.status)
	}
}

// TestRateLimitBadRender: a rate, window or cost that renders to anything
// but a usable positive number is never unlimited, and never answered by
// the fail policy (that is for Redis faults): it is a 400, with fail open
// and fail_closed alike, logged once per template as an error, and writes
// nothing to Redis. Before, fail open admitted it unlimited and
// fail_closed answered 503.
func TestRateLimitBadRender(t *testing.T) {
	t.Parallel()
	for _, closed := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_closed=%v", closed), func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			core, logs := observer.New(zapcore.WarnLevel)
			h := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.Rates = []Rate{rateOf(t, "{plan_rpm}", "{http.request.header.X-Window}")}
				h.Cost = "{http.request.header.X-Cost}"
				h.FailClosed = closed
			})
			h.logger = zap.New(core)
			for _, tc := range []struct{ rpm, window, cost, reason string }{
				{"abc", "1m", "1", "rate"}, {"0", "1m", "1", "rate"}, {"-4", "1m", "1", "rate"}, {"", "1m", "1", "rate"},
				{"3.5", "1m", "1", "rate"}, {"+5", "1m", "1", "rate"}, {"5e1", "1m", "1", "rate"}, {" 5", "1m", "1", "rate"},
				{"100001", "1m", "1", "rate"}, // more than sliding_window accepts
				{"18446744073709551616", "1m", "1", "rate"}, {"9223372036854775807", "1m", "1", "rate"},
				{"5", "", "1", "rate"}, {"5", "soon", "1", "rate"}, {"5", "0s", "1", "rate"}, {"5", "1us", "1", "rate"},
				{"5", "-1m", "1", "rate"}, {"5", " 1m", "1", "rate"},
				{"5", "1m", "0", "cost"}, {"5", "1m", "x", "cost"}, {"5", "1m", "", "cost"}, {"5", "1m", "+1", "cost"},
				{"abc", "1m", "1", "rate"}, {"5", "soon", "1", "rate"}, // the same templates again: not logged again
			} {
				for i := 0; i < 3; i++ {
					a := serveRL(h, "192.0.2.71", func(req *http.Request, repl *caddy.Replacer) {
						req.Header.Set("X-Window", tc.window)
						req.Header.Set("X-Cost", tc.cost)
						withPlan(tc.rpm)(req, repl)
					})
					if a.passed || a.status != http.StatusBadRequest || a.retryAfter() != -1 {
						t.Fatalf("%+v: want 400 without Retry-After, got passed=%v %d %q", tc, a.passed, a.status, a.header.Get(HeaderRetryAfter))
					}
					if !strings.Contains(a.err.Error(), tc.reason) {
						t.Fatalf("%+v: the reason %q does not name the %s", tc, a.err, tc.reason)
					}
				}
			}
			if n := logs.FilterLevelExact(zapcore.ErrorLevel).Len(); n != 2 {
				t.Errorf("%d error logs, want 2 (once per template: the rate, the cost): %v", n, logs.All())
			}
			if n := logs.FilterMessageSnippet("redis unavailable").Len(); n != 0 {
				t.Errorf("a bad render was logged as a Redis fault")
			}
			if keys, _ := r.Client().Keys(context.Background(), "*").Result(); len(keys) != 0 {
				t.Fatalf("bad renders wrote %v", keys)
			}
			// A good render is limited.
			good := func(req *http.Request, repl *caddy.Replacer) {
				req.Header.Set("X-Window", "1m")
				req.Header.Set("X-Cost", "2")
				withPlan("5")(req, repl)
			}
			for i, want := range []bool{true, true, false} {
				if a := serveRL(h, "192.0.2.71", good); a.passed != want {
					t.Fatalf("good render %d: passed=%v, want %v (%d)", i, a.passed, want, a.status)
				}
			}
		})
	}
}

// TestRateLimitCostSequence: costs count in every rate, in the headers and
// in Retry-After; a cheaper request passes where a dearer one was just
// rejected (the deny cache keeps costs apart); a cost above n is rejected
// at once without calling Redis.
func TestRateLimitCostSequence(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
			h.Cost = "{http.request.header.X-Cost}"
		})
		cost := func(c int) func(*http.Request, *caddy.Replacer) {
			return func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-Cost", strconv.Itoa(c)) }
		}
		for i, step := range []struct {
			cost   int
			passed bool
			rem    int
			raMin  int
			raMax  int
		}{
			{3, true, 7, -1, -1},
			{4, true, 3, -1, -1},
			{4, false, 3, 5, 60}, // 3 remain, too few; sliding: all 10 slots age out after 1m; gcra: one unit, 6s
			{4, false, 3, 5, 60}, // from the deny cache
			{3, true, 0, -1, -1}, // cheaper: asks Redis, fits exactly
			{1, false, 0, 5, 60},
		} {
			a := serveRL(h, "192.0.2.72", cost(step.cost))
			if a.passed != step.passed {
				t.Fatalf("step %d (cost %d): passed=%v, want %v (%d, RateLimit %q)", i, step.cost, a.passed, step.passed, a.status, a.header.Get(HeaderRateLimit))
			}
			if _, rem, _ := rlState(t, a); rem != step.rem {
				t.Fatalf("step %d (cost %d): remaining %d, want %d", i, step.cost, rem, step.rem)
			}
			if ra := a.retryAfter(); ra < step.raMin || ra > step.raMax {
				t.Fatalf("step %d (cost %d): Retry-After %d, want %d..%d", i, step.cost, ra, step.raMin, step.raMax)
			}
		}
		// gcra: 4 units take 4×6s to come back; the rejection says so.
		if algo == algoGCRA {
			h.deny = h.newDenyCache()
			if a := serveRL(h, "192.0.2.72", cost(4)); a.passed || a.retryAfter() < 23 || a.retryAfter() > 24 {
				t.Fatalf("gcra cost 4 on an empty bucket: Retry-After %d, want 24", a.retryAfter())
			}
		}
		calls := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		a := serveRL(h, "192.0.2.73", cost(11))
		if a.passed || a.status != 429 || a.retryAfter() != -1 {
			t.Fatalf("cost 11 > n 10: want 429 without Retry-After, got passed=%v %d %q", a.passed, a.status, a.header.Get(HeaderRetryAfter))
		}
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval"); got != calls {
			t.Fatalf("cost above n made %d script calls, want 0", got-calls)
		}
		if a := serveRL(h, "192.0.2.73", cost(10)); !a.passed {
			t.Fatal("cost n on a fresh key rejected")
		}
	})
}

// TestRateLimitCountTwoInstances: with `count 401`, 10 failing logins at
// once over two instances reach the upstream exactly n times (each holds a
// reservation while it runs); answers that do not count return theirs.
func TestRateLimitCountTwoInstances(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		const n = 3
		mk := func(timeout time.Duration) *RedisRateLimit {
			return newRL(func(h *RedisRateLimit) {
				h.Key = "{http.request.header.X-User}"
				h.Rates = []Rate{{Requests: n, Window: caddy.Duration(10 * time.Minute)}}
				h.Count = []string{"401"}
				h.Timeout = caddy.Duration(timeout)
				h.FailClosed = true // a call given up on a loaded machine must not reach the upstream
			})
		}
		hs := []*RedisRateLimit{mk(3 * time.Second), mk(3100 * time.Millisecond)}
		var reached atomic.Int64
		login := func(status int) caddyhttp.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) error {
				// Every admitted login stays until all n are inside: all in
				// flight at once.
				reached.Add(1)
				waitFor(10*time.Second, func() bool { return reached.Load() >= n })
				w.WriteHeader(status)
				return nil
			}
		}
		user := func(u string) func(*http.Request, *caddy.Replacer) {
			return func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-User", u) }
		}
		var wg sync.WaitGroup
		for i := 0; i < 10; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				a := serveRLWith(context.Background(), hs[i%2], "192.0.2.74", user("mallory"), login(http.StatusUnauthorized))
				if !a.passed && a.status != 429 {
					t.Errorf("status %d err %v", a.status, a.err)
				}
			}(i)
		}
		wg.Wait()
		if got := reached.Load(); got != n {
			t.Fatalf("%d failing logins reached the upstream, want exactly %d", got, n)
		}

		// Successful logins (and an error answer not listed) give their
		// reservations back, also many at once: the quota stays whole.
		reached.Store(0)
		for round := 0; round < 3; round++ {
			for i := 0; i < 6; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					next := login(http.StatusOK)
					if i == 5 {
						next = func(w http.ResponseWriter, r *http.Request) error {
							reached.Add(1)
							return caddyhttp.Error(http.StatusBadGateway, fmt.Errorf("upstream down"))
						}
					}
					serveRLWith(context.Background(), hs[i%2], "192.0.2.75", user("alice"), next)
				}(i)
			}
			wg.Wait()
		}
		if got := reached.Load(); got < 3*n {
			t.Fatalf("only %d of 18 answers that do not count got through", got)
		}
		for i := 0; i < n; i++ {
			if a := serveRLWith(context.Background(), hs[i%2], "192.0.2.75", user("alice"), login(http.StatusUnauthorized)); !a.passed {
				t.Fatalf("failing login %d after successes rejected: returned reservations were kept", i)
			}
		}
		if a := serveRLWith(context.Background(), hs[0], "192.0.2.75", user("alice"), login(http.StatusUnauthorized)); a.passed {
			t.Fatalf("failing login %d admitted", n+1)
		}
	})
}

// TestRateLimitWaitPacing: with wait, 15 requests at once against 5/s are
// all admitted, held until their slots, never more than 5 in any second;
// a client that goes away while held stops waiting at once and uses no
// quota; a request beyond what wait absorbs is rejected at once.
func TestRateLimitWaitPacing(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 5, Window: caddy.Duration(time.Second)}}
			h.Wait = caddy.Duration(5 * time.Second)
		})
		var mu sync.Mutex
		var arrivals []time.Time
		var wg sync.WaitGroup
		start := time.Now()
		for i := 0; i < 15; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a := serveRLWith(context.Background(), h, "192.0.2.76", nil, func(w http.ResponseWriter, r *http.Request) error {
					mu.Lock()
					arrivals = append(arrivals, time.Now())
					mu.Unlock()
					return nil
				})
				if !a.passed {
					t.Errorf("request rejected with wait: %d %v", a.status, a.err)
				}
			}()
		}
		wg.Wait()
		if len(arrivals) != 15 {
			t.Fatalf("%d of 15 reached the upstream", len(arrivals))
		}
		sortTimes(arrivals)
		// Local timers start after the answer: allow some jitter.
		const jitter = 150 * time.Millisecond
		for i := range arrivals {
			for j := i; j < len(arrivals); j++ {
				k, span := j-i+1, arrivals[j].Sub(arrivals[i])
				if algo == algoSliding && span < time.Second-jitter && k > 5 {
					t.Fatalf("%d requests within %s, limit 5 per second", k, span)
				}
				// gcra: at most burst + t·n/w in any interval t.
				if algo == algoGCRA && float64(k) > 5+(span+jitter).Seconds()*5+1e-9 {
					t.Fatalf("%d requests within %s, more than burst + t·n/w", k, span)
				}
			}
		}
		if span := arrivals[14].Sub(start); span < 1800*time.Millisecond || span > 6*time.Second {
			t.Fatalf("15 requests at 5/s took %s, want about 2s", span)
		}

		// A client that goes away while held stops waiting at once and
		// uses none of the quota.
		hc := newRL(func(h *RedisRateLimit) {
			h.Prefix = "cancel:"
			// A window long enough that the held request's slot is still
			// ahead when its client goes away, on a loaded machine too
			// (with 2s, a CI run once cancelled just as the slot came).
			h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(6 * time.Second)}}
			h.Wait = caddy.Duration(10 * time.Second)
		})
		if a := serveRL(hc, "192.0.2.78", nil); !a.passed || a.elapsed > time.Second {
			t.Fatalf("first request: passed=%v after %s", a.passed, a.elapsed)
		}
		keys, _ := r.Client().Keys(context.Background(), "cancel:*").Result()
		if len(keys) != 1 {
			t.Fatalf("keys %v", keys)
		}
		state := func() string {
			if algo == algoGCRA { // the TAT ("TAT S X ..." once returns happened)
				return strings.Fields(r.Client().Get(context.Background(), keys[0]).Val())[0]
			}
			m, err := rlRingTimes(context.Background(), r.Client(), keys[0], 1)
			if err != nil {
				t.Fatal(err)
			}
			return fmt.Sprint(m)
		}
		before := state()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan rlAnswer, 1)
		go func() { done <- serveRLWith(ctx, hc, "192.0.2.78", nil, nil) }()
		if !waitFor(10*time.Second, func() bool { return state() != before }) {
			t.Fatal("the held request never reserved its slot")
		}
		cancel()
		select {
		case a := <-done:
			if a.passed || a.status != statusClientClosedRequest {
				t.Fatalf("held client that went away: passed=%v status %d, want 499", a.passed, a.status)
			}
		case <-time.After(time.Second):
			t.Fatal("a held request whose client went away kept waiting")
		}
		if after := state(); after != before {
			t.Fatalf("the slot of a client that went away was not returned: %s, before %s", after, before)
		}
		// Its slot is free again: the next request is held until the
		// first one's window ends (under 6s from now), not the returned
		// one's (12s after the first).
		a := serveRLWith(context.Background(), hc, "192.0.2.78", nil, nil)
		if !a.passed || a.elapsed > 6500*time.Millisecond {
			t.Fatalf("after a return: passed=%v after %s, want within the first's window (under 6s)", a.passed, a.elapsed)
		}

		// Beyond wait: rejected at once.
		h2 := newRL(func(h *RedisRateLimit) {
			h.Prefix = "short:"
			h.Rates = []Rate{{Requests: 2, Window: caddy.Duration(10 * time.Second)}}
			h.Wait = caddy.Duration(500 * time.Millisecond)
		})
		for i := 0; i < 2; i++ {
			serveRL(h2, "192.0.2.77", nil)
		}
		a = serveRL(h2, "192.0.2.77", nil)
		if a.passed || a.status != 429 || a.elapsed > time.Second || a.retryAfter() < 4 {
			t.Fatalf("beyond wait: passed=%v %d after %s Retry-After %d, want 429 at once", a.passed, a.status, a.elapsed, a.retryAfter())
		}
	})
}

// eachAlgorithm runs f as a parallel subtest per algorithm, each with a
// Redis of its own; newRL provisions a handler of that algorithm against it.
func eachAlgorithm(t *testing.T, f func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit)) {
	for _, algo := range []string{algoSliding, algoGCRA} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			f(t, algo, r, func(mod func(*RedisRateLimit)) *RedisRateLimit {
				return newRateLimit(t, r, func(h *RedisRateLimit) {
					h.Algorithm = algo
					mod(h)
				})
			})
		})
	}
}

func sortTimes(ts []time.Time) {
	for i := 1; i < len(ts); i++ {
		for j := i; j > 0 && ts[j].Before(ts[j-1]); j-- {
			ts[j], ts[j-1] = ts[j-1], ts[j]
		}
	}
}

var _ = strings.Contains

// TestRateLimitPlansOnCluster: placeholder rates, cost, count's return and
// wait's reservation run on a 3-master Cluster (every key of a decision and
// of its return shares one hash slot).
func TestRateLimitPlansOnCluster(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	h := newRateLimit(t, rs[0], func(h *RedisRateLimit) {
		h.Addresses, h.Cluster = nil, []string{rs[0].Addr, rs[1].Addr}
		h.Key = "{http.request.header.U}"
		h.Rates = []Rate{rateOf(t, "{plan_rpm}", "1m"), rateOf(t, "100", "{http.request.header.W}")}
		h.Cost = "{http.request.header.C}"
		h.Count = []string{"401"}
		h.Wait = caddy.Duration(2 * time.Second)
	})
	for _, user := range []string{"u1", "u2", "u3", "u4"} {
		prep := func(cost string) func(*http.Request, *caddy.Replacer) {
			return func(req *http.Request, repl *caddy.Replacer) {
				req.Header.Set("U", user)
				req.Header.Set("W", "1h")
				req.Header.Set("C", cost)
				withPlan("4")(req, repl)
			}
		}
		fail := func(w http.ResponseWriter, r *http.Request) error { w.WriteHeader(401); return nil }
		// Answers that do not count give their 3 units back every time.
		for i := 0; i < 5; i++ {
			if a := serveRLWith(context.Background(), h, "192.0.2.80", prep("3"), nil); !a.passed || a.err != nil {
				t.Fatalf("%s: success %d: %d %v", user, i, a.status, a.err)
			}
		}
		if a := serveRLWith(context.Background(), h, "192.0.2.80", prep("3"), fail); !a.passed {
			t.Fatalf("%s: first counted failure rejected: %d %v", user, a.status, a.err)
		}
		// 1 unit left of 4: a cost of 2 would wait a minute, beyond wait.
		if a := serveRLWith(context.Background(), h, "192.0.2.80", prep("2"), fail); a.passed || a.status != 429 {
			t.Fatalf("%s: cost 2 with 1 left: passed=%v %d", user, a.passed, a.status)
		}
		if a := serveRLWith(context.Background(), h, "192.0.2.80", prep("1"), fail); !a.passed {
			t.Fatalf("%s: cost 1 with 1 left rejected: %d %v", user, a.status, a.err)
		}
	}
}

// TestRateLimitCountRoundTrips: an answer that counts costs one script
// call, one that does not two (its return); the time held by wait is in
// caddy_redis_ratelimit_waited_seconds.
func TestRateLimitCountRoundTrips(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = []Rate{{Requests: 100, Window: caddy.Duration(time.Minute)}}
		h.Count = []string{"4xx"}
		h.Wait = caddy.Duration(time.Second)
		h.Timeout = caddy.Duration(5 * time.Second) // no call given up on a loaded machine
	})
	calls := func() int64 { return r.CommandCalls("evalsha") + r.CommandCalls("eval") }
	status := func(code int) caddyhttp.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) error { w.WriteHeader(code); return nil }
	}
	// Load both scripts first (a first call is NOSCRIPT, then EVAL).
	serveRLWith(context.Background(), h, "192.0.2.79", nil, status(http.StatusOK))
	waited0 := rlHistogramCount(h.waited.(prometheus.Histogram))
	c0 := calls()
	for i := 0; i < 5; i++ {
		serveRLWith(context.Background(), h, "192.0.2.79", nil, status(http.StatusNotFound))
	}
	if got := calls() - c0; got != 5 {
		t.Fatalf("5 counted answers made %d script calls, want 5", got)
	}
	c0 = calls()
	for i := 0; i < 5; i++ {
		serveRLWith(context.Background(), h, "192.0.2.79", nil, status(http.StatusOK))
	}
	if got := calls() - c0; got != 10 {
		t.Fatalf("5 answers that do not count made %d script calls, want 10", got)
	}
	if got := rlHistogramCount(h.waited.(prometheus.Histogram)) - waited0; got < 10 {
		t.Fatalf("waited_seconds observed %d admissions of a wait handler, want at least 10", got)
	}
}

// rlHistogramCount reads a prometheus histogram's sample count.
func rlHistogramCount(h interface{ Write(*dto.Metric) error }) uint64 {
	var m dto.Metric
	if err := h.Write(&m); err != nil {
		return 0
	}
	return m.GetHistogram().GetSampleCount()
}

// TestRateLimitCountCrashAgesOut: a reservation whose request never
// settles (here its handler panics, as a crashed instance would leave it)
// holds its slot like any admission and ages out with its window: the key
// expires by itself.
func TestRateLimitCountCrashAgesOut(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}
			h.Count = []string{"401"}
		})
		func() {
			defer func() { _ = recover() }()
			serveRLWith(context.Background(), h, "192.0.2.81", nil, func(w http.ResponseWriter, r *http.Request) error {
				panic("instance crashed before the answer")
			})
		}()
		keys, _ := r.Client().Keys(context.Background(), "caddy:rl:*").Result()
		if len(keys) != 1 {
			t.Fatalf("keys %v, want the reservation's", keys)
		}
		if ttl := r.Client().PTTL(context.Background(), keys[0]).Val(); ttl <= 0 || ttl > 1100*time.Millisecond {
			t.Fatalf("reservation key PTTL %s, want at most the window", ttl)
		}
		if a := serveRL(h, "192.0.2.81", nil); a.passed {
			t.Fatal("the unsettled reservation did not hold its slot")
		}
		time.Sleep(1100 * time.Millisecond)
		if a := serveRL(h, "192.0.2.81", nil); !a.passed {
			t.Fatalf("after the window the slot is still taken: %d", a.status)
		}
	})
}

// TestRateLimitGCRAReturnsOnlyItsOwnUnits: a gcra TAT is one schedule, so
// an admission gives its units back only while it is still the latest on
// the key. Before, a return always moved the TAT back by its cost: a long
// request whose answer did not count erased a later request's counted
// units (two counted 401s 0.4 s apart under `rate 1 2s`), and a held
// client that went away freed the last waiter's slot, so a newcomer passed
// at the same moment as that waiter.
func TestRateLimitGCRAReturnsOnlyItsOwnUnits(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	t.Run("count", func(t *testing.T) {
		t.Parallel()
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Algorithm, h.Prefix = algoGCRA, "count:"
			h.Key = "{http.request.header.X-User}"
			h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(2 * time.Second)}}
			h.Count = []string{"401"}
		})
		user := func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-User", "victim") }
		answer := func(code int, sleep time.Duration) caddyhttp.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) error {
				time.Sleep(sleep)
				w.WriteHeader(code)
				return nil
			}
		}
		slow := make(chan rlAnswer, 1)
		go func() {
			slow <- serveRLWith(context.Background(), h, "192.0.2.9", user, answer(200, 2500*time.Millisecond))
		}()
		time.Sleep(2200 * time.Millisecond) // the slow request's unit has drained
		if b := serveRLWith(context.Background(), h, "192.0.2.9", user, answer(401, 0)); !b.passed {
			t.Fatalf("a request after the window: %d, want admitted", b.status)
		}
		if a := <-slow; !a.passed {
			t.Fatalf("slow request: %d", a.status)
		}
		// The slow request's return came after the counted 401: it must
		// not take that one's unit.
		if c := serveRLWith(context.Background(), h, "192.0.2.9", user, answer(401, 0)); c.passed {
			t.Fatal("a second counted 401 within 0.4 s against rate 1 per 2s (burst 1)")
		}
	})
	t.Run("wait", func(t *testing.T) {
		t.Parallel()
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Algorithm, h.Prefix = algoGCRA, "wait:"
			h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}
			h.Wait = caddy.Duration(5 * time.Second)
		})
		start := time.Now()
		var mu sync.Mutex
		passed := map[string]time.Duration{}
		var wg sync.WaitGroup
		run := func(ctx context.Context, name string) {
			defer wg.Done()
			serveRLWith(ctx, h, "192.0.2.12", nil, func(w http.ResponseWriter, r *http.Request) error {
				mu.Lock()
				passed[name] = time.Since(start)
				mu.Unlock()
				return nil
			})
		}
		// held waits until the key's TAT moved on from what it was: the
		// request just sent is held, its slot reserved.
		held := func(before string) string {
			t.Helper()
			var now string
			if !waitFor(10*time.Second, func() bool {
				now = r.Client().Get(context.Background(), rateKey(h, "192.0.2.12", 0)).Val()
				return now != before
			}) {
				t.Fatal("a request was never held")
			}
			return now
		}
		wg.Add(1)
		run(context.Background(), "w1") // passes at once
		tat := held("")
		ctx2, cancel2 := context.WithCancel(context.Background())
		wg.Add(2)
		w2 := make(chan struct{})
		go func() { defer close(w2); run(ctx2, "w2") }() // held for about 1 s
		tat = held(tat)
		go run(context.Background(), "w3") // held for about 2 s
		held(tat)
		cancel2() // w2 leaves: w3 keeps its moment
		<-w2
		wg.Add(1)
		go run(context.Background(), "n")
		wg.Wait()
		if _, ok := passed["w2"]; ok || len(passed) != 3 {
			t.Fatalf("passed: %v, want w1, w3 and n", passed)
		}
		if d := passed["n"] - passed["w3"]; d < 500*time.Millisecond && d > -500*time.Millisecond {
			t.Fatalf("w3 and n passed %v apart against rate 1 per second (burst 1): %v", d, passed)
		}
	})
}

// TestRateLimitDenyCacheCostlier: a rejection in the deny cache answers only
// requests of its own cost. Before, a costlier request got the cheaper
// one's Retry-After, earlier than the moment it could pass; and a rejected
// request reported r=0 although quota remained (less than its cost).
func TestRateLimitDenyCacheCostlier(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		mk := func() *RedisRateLimit {
			return newRL(func(h *RedisRateLimit) {
				h.Rates = []Rate{{Requests: 4, Window: caddy.Duration(4 * time.Second)}}
				h.Cost = "{http.request.header.X-Cost}"
			})
		}
		cost := func(c int) func(*http.Request, *caddy.Replacer) {
			return func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-Cost", strconv.Itoa(c)) }
		}
		h, ip := mk(), "192.0.2.10"
		if algo == algoSliding {
			// The log's oldest slot leaves first: one unit back after 2.5s,
			// all four only after 4s.
			if a := serveRL(h, ip, cost(1)); !a.passed {
				t.Fatal("first request rejected")
			}
			time.Sleep(1500 * time.Millisecond)
			if a := serveRL(h, ip, cost(3)); !a.passed {
				t.Fatal("second request rejected")
			}
		} else if a := serveRL(h, ip, cost(4)); !a.passed { // gcra: a unit back each second
			t.Fatal("first request rejected")
		}
		if a := serveRL(h, ip, cost(1)); a.passed { // rejected: into the deny cache
			t.Fatal("a fifth unit admitted against rate 4 per 4s")
		}
		b := serveRL(h, ip, cost(4))
		c := serveRL(mk(), ip, cost(4)) // a handler without that cache entry: Redis answers
		if b.passed || c.passed {
			t.Fatalf("cost 4 with no quota left admitted: %v %v", b.passed, c.passed)
		}
		if b.retryAfter() < c.retryAfter() {
			t.Fatalf("cost 4 got Retry-After %d; Redis says %d", b.retryAfter(), c.retryAfter())
		}
		if _, rem, _ := rlState(t, c); rem != 0 {
			t.Fatalf("remaining %d with the whole quota used, want 0", rem)
		}
	})
	// Remaining quota on a rejection: 1 unit left, a request of cost 3.
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 4, Window: caddy.Duration(10 * time.Second)}}
			h.Cost = "{http.request.header.X-Cost}"
		})
		cost := func(c int) func(*http.Request, *caddy.Replacer) {
			return func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-Cost", strconv.Itoa(c)) }
		}
		serveRL(h, "192.0.2.11", cost(3))
		for i := 0; i < 2; i++ { // from Redis, then from the deny cache
			b := serveRL(h, "192.0.2.11", cost(3))
			if _, rem, _ := rlState(t, b); b.passed || rem != 1 {
				t.Fatalf("cost 3 with 1 left (answer %d): passed=%v remaining %d, want rejected with 1", i, b.passed, rem)
			}
		}
		if c := serveRL(h, "192.0.2.11", cost(1)); !c.passed {
			t.Fatal("the unit left was not admitted")
		}
	})
}

// TestRateLimitGCRACountOverlapping: under `rate 3 1m`, `count 401`, three
// overlapping answers that do not count leave the quota whole, in whatever
// order they end: three 401s then pass and a fourth is rejected.
func TestRateLimitGCRACountOverlapping(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for name, sleeps := range map[string][3]time.Duration{
		"in order":   {100 * time.Millisecond, 150 * time.Millisecond, 200 * time.Millisecond},
		"reversed":   {300 * time.Millisecond, 200 * time.Millisecond, 100 * time.Millisecond},
		"first last": {300 * time.Millisecond, 100 * time.Millisecond, 150 * time.Millisecond},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.Algorithm, h.Prefix = algoGCRA, "ov:"+strings.ReplaceAll(name, " ", "")+":"
				h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(time.Minute)}}
				h.Count = []string{"401"}
			})
			answer := func(code int, sleep time.Duration, admitted chan<- struct{}) caddyhttp.HandlerFunc {
				return func(w http.ResponseWriter, r *http.Request) error {
					if admitted != nil {
						close(admitted)
					}
					time.Sleep(sleep) // the upstream's work: the answers end in the order tested
					w.WriteHeader(code)
					return nil
				}
			}
			var wg sync.WaitGroup
			for _, s := range sleeps {
				wg.Add(1)
				admitted := make(chan struct{})
				go func() {
					defer wg.Done()
					if a := serveRLWith(context.Background(), h, "192.0.2.90", nil, answer(200, s, admitted)); !a.passed {
						t.Errorf("overlapping request: %d", a.status)
						close(admitted)
					}
				}()
				select { // admitted in this order
				case <-admitted:
				case <-time.After(10 * time.Second):
					t.Fatal("an overlapping request was never admitted")
				}
			}
			wg.Wait()
			for i := 0; i < 3; i++ {
				if a := serveRLWith(context.Background(), h, "192.0.2.90", nil, answer(401, 0, nil)); !a.passed {
					t.Fatalf("401 number %d rejected: the 200s' reservations were kept", i+1)
				}
			}
			if a := serveRLWith(context.Background(), h, "192.0.2.90", nil, answer(401, 0, nil)); a.passed {
				t.Fatal("a fourth counted 401 admitted against rate 3 per minute")
			}
		})
	}
}

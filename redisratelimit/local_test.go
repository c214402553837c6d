package redisratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// pausedLocal provisions a fail_local handler against a Redis of its own,
// lets mod edit it, and returns it with the Redis, and its warnings.
func pausedLocal(t *testing.T, mod func(h *RedisRateLimit)) (*RedisRateLimit, *testRedis, *observer.ObservedLogs) {
	t.Helper()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.FailLocal = true
		h.Timeout = caddy.Duration(300 * time.Millisecond)
		if mod != nil {
			mod(h)
		}
	})
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	return h, r, logs
}

func countPassed(h *RedisRateLimit, ip string, n int) (passed int, statuses map[int]int) {
	statuses = map[int]int{}
	for i := 0; i < n; i++ {
		a := serveRL(h, ip, nil)
		if a.passed {
			passed++
		}
		statuses[a.status]++
	}
	return passed, statuses
}

// TestFailLocalInstances: with `instances 4`, each instance admits
// ceil(20/4) = 5 of a 20-per-minute rate while Redis is paused (gcra: the
// burst likewise), answers the rest 429 with Retry-After, and counts the
// decisions as local.
func TestFailLocalInstances(t *testing.T) {
	t.Parallel()
	for _, algo := range []string{algoSliding, algoGCRA} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			h, r, logs := pausedLocal(t, func(h *RedisRateLimit) {
				h.Instances = 4
				h.Algorithm = algo
				h.Rates = []Rate{{Requests: 20, Window: caddy.Duration(time.Minute)}, {Requests: 1000, Window: caddy.Duration(time.Hour)}}
			})
			before := counterValue(t, h.counters[shared.ResultLocal])
			r.Pause()
			defer r.Resume()
			passed, statuses := countPassed(h, "192.0.2.7", 20)
			if passed != 5 || statuses[429] != 15 {
				t.Errorf("admitted %d of 20 (statuses %v), want ceil(20/4) = 5 and 15 × 429", passed, statuses)
			}
			if a := serveRL(h, "192.0.2.7", nil); a.passed || a.header.Get(HeaderRetryAfter) == "" || a.header.Get(HeaderRateLimit) == "" {
				t.Errorf("a rejection by the local limiter: passed %v, headers %v", a.passed, a.header)
			}
			if passed, _ := countPassed(h, "192.0.2.8", 8); passed != 5 { // another key, its own share
				t.Errorf("another key: admitted %d of 8, want 5", passed)
			}
			// (Other tests run at the same time: at least.)
			if got := counterValue(t, h.counters[shared.ResultLocal]) - before; got < 29 {
				t.Errorf(`result="local" rose by %v, want at least 29`, got)
			}
			if n := logs.FilterMessageSnippet("enforcing every rate on this instance alone").Len(); n != 1 {
				t.Errorf("%d warnings that local mode starts, want 1", n)
			}
		})
	}
}

// TestFailLocalStartsFromOwnAdmissions: what this instance admitted through
// Redis in the current window counts against its local share.
func TestFailLocalStartsFromOwnAdmissions(t *testing.T) {
	t.Parallel()
	h, r, _ := pausedLocal(t, func(h *RedisRateLimit) {
		h.Instances = 2
		h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
	})
	if passed, _ := countPassed(h, "192.0.2.9", 3); passed != 3 {
		t.Fatalf("with Redis up: %d of 3 admitted", passed)
	}
	r.Pause()
	defer r.Resume()
	if passed, statuses := countPassed(h, "192.0.2.9", 10); passed != 2 {
		t.Errorf("locally: %d admitted (%v), want the share 5 less the 3 admitted before", passed, statuses)
	}
}

// TestFailLocalNoCount: with no instance count ever seen and no
// `instances`, a fail_local instance answers 503 as fail_closed, and says
// why.
func TestFailLocalNoCount(t *testing.T) {
	t.Parallel()
	h, r, logs := pausedLocal(t, nil)
	r.Pause() // before the first heartbeat
	defer r.Resume()
	_, statuses := countPassed(h, "192.0.2.10", 5)
	if statuses[http.StatusServiceUnavailable] != 5 {
		t.Errorf("statuses %v, want 5 × 503", statuses)
	}
	if logs.FilterMessageSnippet("number of instances sharing the limit was never seen").Len() != 1 {
		t.Errorf("no (or repeated) warning saying why: %v", logs.All())
	}
}

// TestFailLocalChargedBack: what the local limiter admitted is charged to
// Redis when Redis answers again (both algorithms), so the window there
// holds it, and decisions come from Redis again.
func TestFailLocalChargedBack(t *testing.T) {
	t.Parallel()
	for _, algo := range []string{algoSliding, algoGCRA} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			h, r, logs := pausedLocal(t, func(h *RedisRateLimit) {
				h.Instances = 2
				h.Algorithm = algo
				h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
			})
			// Another key first: the connection is dialed and the script
			// loaded, so the next decision is Redis's within the timeout
			// on a loaded machine (one that timed out would be decided
			// locally too, and counted both ways: stricter).
			countPassed(h, "192.0.2.13", 2)
			if passed, _ := countPassed(h, "192.0.2.11", 1); passed != 1 {
				t.Fatal("with Redis up: not admitted")
			}
			r.Pause()
			if passed, statuses := countPassed(h, "192.0.2.11", 6); passed != 4 {
				t.Errorf("locally: %d admitted (%v), want 5 - 1", passed, statuses)
			}
			r.Resume()
			// Redis decides again within seconds, and its window holds the
			// 1 + 4 admissions: 5 more pass, then 429 from Redis.
			if !waitFor(10*time.Second, func() bool {
				serveRL(h, "192.0.2.12", nil) // another key: a decision by Redis ends local mode
				return !h.local.lim.Pending() && !h.local.mode.Load()
			}) {
				t.Fatal("local admissions not charged 10s after Redis came back")
			}
			// The calls sent before the breaker opened time out, but Redis
			// runs them when it wakes: they count there too (stricter).
			views, _, _, found, err := h.peekQuota(t.Context(), "192.0.2.11")
			if err != nil || !found || len(views) != 1 || views[0].Used < 5 || views[0].Used > 5+ratelimit.BreakerThreshold {
				t.Fatalf("Redis holds %+v (%v, %v), want used 5 (1 through Redis, 4 charged back), plus at most the %d calls the breaker let through", views, found, err, ratelimit.BreakerThreshold)
			}
			// Back from local mode, the instance holds the key to its share
			// too for ReturnCap (TestFailLocalReturnCap): then Redis alone.
			time.Sleep(time.Until(time.Unix(0, h.local.back.Load()).Add(ReturnCap)))
			left := int(10 - views[0].Used)
			passed, statuses := countPassed(h, "192.0.2.11", left+2)
			if passed != left || statuses[429] != 2 {
				t.Errorf("after the outage: %d admitted (%v), want %d and 2 × 429", passed, statuses, left)
			}
			if logs.FilterMessageSnippet("local rate limiting (fail_local) ends").Len() != 1 {
				t.Errorf("no warning that local mode ended")
			}
		})
	}
}

// TestFailLocalResetReachesOtherInstance: an admin reset made through one
// instance (A) clears the key in the fail_local limiter of another (B, its
// own Redis client and reset listener on the same Redis), which only the
// Pub/Sub reset reaches: while Redis answered, B noted its admissions of
// the key (its local limiter starts from them), so in an outage after the
// reset B admits the key's full share again, where without the reset it
// would admit nothing.
func TestFailLocalResetReachesOtherInstance(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	rates := []Rate{{Requests: 3, Window: caddy.Duration(time.Minute)}}
	a := newRateLimit(t, r, func(h *RedisRateLimit) { h.Rates = rates })
	b := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = rates
		h.FailLocal, h.Instances = true, 1
		h.Timeout = caddy.Duration(400 * time.Millisecond) // another pool key: a client of its own
	})
	if a.client == b.client {
		t.Fatal("both handlers share one client; want two instances")
	}
	const ip = "192.0.2.20"
	if passed, statuses := countPassed(b, ip, 4); passed != 3 || statuses[429] != 1 {
		t.Fatalf("B with Redis up: %d admitted (%v), want 3 and a 429", passed, statuses)
	}
	if b.deny.Len() != 1 {
		t.Fatalf("B's deny cache holds %d entries, want the rejection", b.deny.Len())
	}
	admin := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer admin.Close()
	// B's listener subscribes with its client's first decision.
	if !waitFor(10*time.Second, func() bool {
		n, err := admin.PubSubNumSub(t.Context(), ratelimit.ForgetChannel).Result()
		return err == nil && n[ratelimit.ForgetChannel] >= 1
	}) {
		t.Fatal("no reset listener subscribed")
	}
	w := httptest.NewRecorder()
	if err := a.resetQuota(w, httptest.NewRequest(http.MethodDelete, "/", nil), []*RedisRateLimit{a}, ip); err != nil {
		t.Fatalf("reset through A: %v", err)
	}
	// The reset forgets the key in B's local limiter, then its deny cache.
	if !waitFor(time.Second, func() bool { return b.deny.Len() == 0 }) {
		t.Fatal("B's deny cache still holds the key a second after the reset")
	}
	r.Pause()
	defer r.Resume()
	if passed, statuses := countPassed(b, ip, 4); passed != 3 || statuses[429] != 1 {
		t.Errorf("B locally after the reset: %d admitted (%v), want its share 3 again and a 429", passed, statuses)
	}
}

// TestFailLocalConfig: fail_local with fail_closed, and instances without
// fail_local or below 1, are config errors (naming the line in a
// Caddyfile).
func TestFailLocalConfig(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ body, want string }{
		{"rate 5 1s\n\tfail_closed\n\tfail_local", "Testfile:4"},
		{"rate 5 1s\n\tfail_local\n\tfail_closed", "Testfile:4"},
		{"rate 5 1s\n\tinstances 3", "instances: only valid with fail_local, at Testfile:3"},
		{"rate 5 1s\n\tfail_local\n\tinstances 0", "Testfile:4"},
		{"rate 5 1s\n\tfail_local\n\tinstances 2\n\tinstances 3", "Testfile:5"},
		{"rate 5 1s\n\tfail_local yes", "Testfile:3"},
	} {
		d := caddyfile.NewTestDispenser("redis_ratelimit {\n\t" + c.body + "\n}")
		err := new(RedisRateLimit).UnmarshalCaddyfile(d)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error with %q", c.body, err, c.want)
		}
	}
	h := new(RedisRateLimit)
	d := caddyfile.NewTestDispenser("redis_ratelimit {\n\trate 5 1s\n\tfail_local\n\tinstances 3\n}")
	if err := h.UnmarshalCaddyfile(d); err != nil || !h.FailLocal || h.Instances != 3 {
		t.Errorf("fail_local + instances 3: %v, %+v", err, h)
	}
	for _, cfg := range []string{`{"rates":[{"requests":1,"window":"1s"}],"fail_local":true,"fail_closed":true}`,
		`{"rates":[{"requests":1,"window":"1s"}],"instances":2}`, `{"rates":[{"requests":1,"window":"1s"}],"fail_local":true,"instances":-1}`} {
		h := new(RedisRateLimit)
		if err := json.Unmarshal([]byte(cfg), h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil {
			t.Errorf("%s: valid, want an error", cfg)
		}
	}
}

// counterValue reads a counter (shared by every handler of the process:
// compare before and after).
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// TestFailLocalChargesOfAKeyInOrder: while a batch of a key's charges is on
// its way (taken by one sender), a request of the key neither sends the
// key's newer charges nor is decided by Redis (which does not know the
// batch yet): it is decided locally. Newer charges sent first would move
// the key's charge marker past the batch, which the script would then
// skip: charged 1 of 4 (seen before the fix). The request is admitted
// locally without starting local mode (Redis answers).
func TestFailLocalChargesOfAKeyInOrder(t *testing.T) {
	t.Parallel()
	for _, algo := range []string{algoSliding, algoGCRA} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			h := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.FailLocal, h.Instances, h.Algorithm = true, 1, algo
				h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
			})
			onFreshKey(t, h, 40, "the fleet loop took the batch first in every try", func(ip string, rates []ratelimit.LocalRate) bool {
				for i := 0; i < 3; i++ {
					h.local.lim.Admit(rates, 1, 1, time.Now())
				}
				now := time.Now()
				batches := h.local.lim.TakeCharges(now)
				mine := slices.IndexFunc(batches, func(b ratelimit.ChargeBatch) bool { return b.Rate.Key == rates[0].Key })
				if mine < 0 {
					for _, b := range batches {
						h.local.lim.Untake(b)
					}
					return false
				}
				h.local.lim.Admit(rates, 1, 1, time.Now()) // a fourth, while the three are on their way
				if err := h.chargeFirst(t.Context(), ip, &h.static); !errors.Is(err, errChargeOnItsWay) {
					t.Fatalf("a request of the key while its batch is on its way: %v, want it decided locally (%v)", err, errChargeOnItsWay)
				}
				// Decided locally, without local mode (Redis answers).
				if a := serveRL(h, ip, nil); !a.passed || h.local.mode.Load() {
					t.Fatalf("the request while its key's batch is on its way: passed %v, local mode %v; want admitted locally, not in local mode", a.passed, h.local.mode.Load())
				}
				if views, _, _, _, err := h.peekQuota(t.Context(), ip); err != nil || len(views) != 1 || views[0].Used != 0 {
					t.Fatalf("Redis holds %+v (%v) before the batch lands, want nothing: the newer charge must wait", views, err)
				}
				if err := h.charge(t.Context(), h.logger, batches, 5*time.Second); err != nil {
					t.Fatal(err)
				}
				if !waitFor(10*time.Second, func() bool {
					h.chargeLocal(t.Context())
					return !h.local.lim.PendingFor(rates)
				}) {
					t.Fatal("the newer admissions were never charged")
				}
				views, _, _, found, err := h.peekQuota(t.Context(), ip)
				if err != nil || !found || len(views) != 1 || views[0].Used != 5 {
					t.Fatalf("Redis holds %+v (%v, %v), want used 5: every local admission (3, the fourth, the request decided locally), once", views, found, err)
				}
				return true
			})
		})
	}
}

// TestFailLocalChargeRefusedGoesOnToRedis: a request whose key's charge
// Redis refuses for good (here its charge marker holds a key of another
// type) is decided by Redis, which answers: the charge is dropped with a
// warning, and neither a local decision nor local mode follows.
func TestFailLocalChargeRefusedGoesOnToRedis(t *testing.T) {
	t.Parallel()
	for _, algo := range []string{algoSliding, algoGCRA} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			rc := r.Client()
			h := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.FailLocal, h.Instances, h.Algorithm = true, 1, algo
				h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
			})
			core, logs := observer.New(zapcore.WarnLevel)
			h.logger = zap.New(core)
			// A key whose batch the fleet loop took first logs its warning
			// to the loop's logger: try the next.
			onFreshKey(t, h, 60, "no warning of the request's refused charge in any try (the fleet loop took the batch first every time, or the request never charged)", func(ip string, rates []ratelimit.LocalRate) bool {
				if err := rc.HSet(t.Context(), h.local.lim.ChargeMarker(rates[0].Key), "f", "v").Err(); err != nil {
					t.Fatal(err)
				}
				for i := 0; i < 2; i++ {
					h.local.lim.Admit(rates, 1, 1, time.Now())
				}
				before := counterValue(t, h.counters[shared.ResultLocal])
				a := serveRL(h, ip, nil)
				if logs.FilterMessageSnippet("refused charges").FilterField(zap.String("key", rates[0].Key)).Len() == 0 {
					return false
				}
				if !a.passed || a.err != nil {
					t.Fatalf("request: passed %v, %v", a.passed, a.err)
				}
				if h.local.mode.Load() || counterValue(t, h.counters[shared.ResultLocal]) != before {
					t.Fatalf("local mode %v, local decisions +%v: want the request decided by redis", h.local.mode.Load(), counterValue(t, h.counters[shared.ResultLocal])-before)
				}
				if h.local.lim.PendingFor(rates) {
					t.Error("the refused charge is still pending")
				}
				views, _, _, found, err := h.peekQuota(t.Context(), ip)
				if err != nil || !found || len(views) != 1 || views[0].Used != 1 {
					t.Fatalf("Redis holds %+v (%v, %v), want used 1: the request, decided by redis; the refused charge dropped", views, found, err)
				}
				return true
			})
		})
	}
}

// onFreshKey runs try on a fresh client key of h (192.0.2.<base+n>) until
// one returns true, and fails the test after 5: the fleet loop charges in
// the background too, and may take a key's batch first. msg says what
// failed every time.
func onFreshKey(t *testing.T, h *RedisRateLimit, base int, msg string, try func(ip string, rates []ratelimit.LocalRate) bool) {
	t.Helper()
	for n := 0; n < 5; n++ {
		ip := fmt.Sprintf("192.0.2.%d", base+n)
		if try(ip, h.localRates(ip, &h.static)) {
			return
		}
	}
	t.Fatal(msg)
}

// TestFailLocalRetryAfter: a local 429 while Redis is
// unreachable says when this instance asks Redis again (the next probe,
// about a second), not when its local share grows (here most of a
// 10 s window): once Redis answers, it admits the key at once. The
// rejection of the return's hold, which Redis decides a second later at
// most, says 1 as well.
func TestFailLocalRetryAfter(t *testing.T) {
	t.Parallel()
	h, r, _ := pausedLocal(t, func(h *RedisRateLimit) {
		h.Instances = 2
		h.Rates = []Rate{{Requests: 4, Window: caddy.Duration(10 * time.Second)}}
	})
	const ip = "192.0.2.67"
	r.Pause()
	resumed := false
	defer func() {
		if !resumed {
			r.Resume()
		}
	}()
	if passed, statuses := countPassed(h, ip, 2); passed != 2 {
		t.Fatalf("locally: %d of 2 admitted (%v), want the share 2", passed, statuses)
	}
	a := serveRL(h, ip, nil)
	if a.passed || a.status != http.StatusTooManyRequests || a.retryAfter() != 1 {
		t.Errorf("the share spent while Redis is unreachable: status %d, Retry-After %d, want 429 with 1 (the next probe)", a.status, a.retryAfter())
	}
	r.Resume()
	resumed = true
	// Back to Redis (another key's request ends local mode): within the
	// return's hold the key's share is still spent.
	if !waitFor(10*time.Second, func() bool {
		serveRL(h, "192.0.2.68", nil)
		return !h.local.mode.Load() && !h.local.lim.Pending()
	}) {
		t.Fatal("not back to Redis 10 s after it came back")
	}
	back := time.Unix(0, h.local.back.Load())
	a = serveRL(h, ip, nil)
	if time.Since(back) < ReturnCap && (a.passed || a.retryAfter() != 1) {
		t.Errorf("within the return's hold: passed %v, Retry-After %d, want 429 with 1 (Redis decides within a second)", a.passed, a.retryAfter())
	}
	// Redis holds the 2 local admissions (and maybe the call that met the
	// paused Redis): it admits the key as soon as it decides.
	start := time.Now()
	if !waitFor(10*time.Second, func() bool { return serveRL(h, ip, nil).passed }) {
		t.Fatal("the key not admitted by Redis 10 s after it came back")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the key admitted %v after the return, want within about a second (bound 5 s)", took)
	}
}

// TestFailLocalFullAnswers503: with the local limiter
// full of keys whose local admissions still wait to be charged, a new key
// is answered as fail_closed (503, Retry-After 1), counted as an error
// and logged, while the keys it holds are still decided locally; none of
// their charges is dropped.
func TestFailLocalFullAnswers503(t *testing.T) {
	t.Parallel()
	h, r, logs := pausedLocal(t, func(h *RedisRateLimit) {
		h.Instances = 1
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}
	})
	r.Pause()
	defer r.Resume()
	ip := func(i int) string { return fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255) }
	for i := range localRatesMax {
		if a := serveRL(h, ip(i), nil); !a.passed {
			t.Fatalf("key %d of %d: status %d, want admitted locally", i, localRatesMax, a.status)
		}
	}
	errs := counterValue(t, h.counters[shared.ResultError])
	a := serveRL(h, ip(localRatesMax), nil)
	if a.status != http.StatusServiceUnavailable || a.retryAfter() != 1 {
		t.Errorf("a new key with the limiter full of charges: status %d, Retry-After %d, want 503 with 1", a.status, a.retryAfter())
	}
	if got := counterValue(t, h.counters[shared.ResultError]) - errs; got != 1 {
		t.Errorf(`result="error" rose by %v, want 1`, got)
	}
	if logs.FilterMessageSnippet("full of admissions still to charge").Len() != 1 {
		t.Errorf("no warning that the local limiter is full: %v", logs.All())
	}
	if a := serveRL(h, ip(7), nil); a.status != http.StatusTooManyRequests {
		t.Errorf("a key the limiter holds: status %d, want 429 of its spent share", a.status)
	}
	var cost int64
	for _, b := range h.local.lim.TakeCharges(time.Now()) {
		for _, c := range b.Charges {
			cost += c.Cost
		}
		h.local.lim.Done(b)
	}
	if cost != localRatesMax {
		t.Errorf("%d admissions to charge, want all %d", cost, localRatesMax)
	}
}

// TestFailLocalRestartKeepsN: Redis restarted empty drops the heartbeat
// set with the windows; as the instances beat again it fills up, and a
// count read meanwhile is too low (a bigger share). Two other instances
// keep a heartbeat here (N = 3) until the restart and then stay away: the
// handler still uses N = 3 for a heartbeat's life after it saw the
// restart, and the count of the set after that.
func TestFailLocalRestartKeepsN(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.FailLocal = true
		h.Timeout = caddy.Duration(300 * time.Millisecond)
	})
	others := func() {
		now, _ := r.Client().Time(t.Context()).Result()
		r.Client().ZAdd(t.Context(), ratelimit.FleetKey(h.Prefix), redis.Z{Score: float64(now.UnixMicro()), Member: "other-1"}, redis.Z{Score: float64(now.UnixMicro()), Member: "other-2"})
	}
	if !waitFor(15*time.Second, func() bool { others(); return h.instances() == 3 }) {
		t.Fatalf("N = %d, want 3 from the heartbeats", h.instances())
	}
	r.Restart()
	if !waitFor(15*time.Second, func() bool { return h.local.restart.at.Load() != 0 }) {
		t.Fatal("the restart not seen 15 s on")
	}
	seen := time.Unix(0, h.local.restart.at.Load())
	// The handler beats about every second: it reads a count of 1 now.
	for time.Since(seen) < ratelimit.HeartbeatLife-500*time.Millisecond {
		if n := h.instances(); n != 3 {
			t.Fatalf("N = %d %v after the restart was seen, want 3 for a heartbeat's life", n, time.Since(seen))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !waitFor(10*time.Second, func() bool { return h.instances() == 1 }) {
		t.Errorf("N = %d 10 s after a heartbeat's life, want the set's count 1", h.instances())
	}
}

// TestFailLocalJoining: an instance new in the heartbeat set, whose other
// instance has not beaten since (its N does not count this one yet, so its
// share is too big by this one's), admits nothing: its requests wait until
// the other has counted it (up to joinWait), and then Redis decides; an
// outage before that finds it with no share (503, as fail_closed).
func TestFailLocalJoining(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	other := func() {
		now, _ := r.Client().Time(t.Context()).Result()
		r.Client().ZAdd(t.Context(), DefaultRateLimitPrefix+"{~fleet}:instances", redis.Z{Score: float64(now.UnixMicro()), Member: "other"})
	}
	join := func() *RedisRateLimit {
		other()
		return newRateLimit(t, r, func(h *RedisRateLimit) {
			h.FailLocal = true
			h.Timeout = caddy.Duration(300 * time.Millisecond)
			h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
		})
	}
	// A request made while joining waits until the other instance counted
	// this one (its next heartbeat, 1 s later here), then Redis decides it.
	h := join()
	beat := time.AfterFunc(time.Second, other)
	defer beat.Stop()
	const ip = "192.0.2.69"
	start := time.Now()
	if res := serveRL(h, ip, nil); !res.passed || h.instances() != 2 {
		t.Fatalf("a request while joining: passed %v, N %d; want it admitted once counted, with N = 2", res.passed, h.instances())
	}
	if waited := time.Since(start); waited < 900*time.Millisecond {
		t.Errorf("the request was decided %v after it came, before the other instance counted this one (1 s)", waited)
	}
	if passed, statuses := countPassed(h, ip, 12); passed != 9 {
		t.Errorf("after joining: %d of 12 admitted (%v), want the 9 left of 10 (Redis decides)", passed, statuses)
	}
	// An outage that begins while an instance is joining finds it with no
	// share: 503, as fail_closed.
	h2 := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.FailLocal = true
		h.Prefix = "joining2:"
		h.Timeout = caddy.Duration(300 * time.Millisecond)
		h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
	})
	now, _ := r.Client().Time(t.Context()).Result()
	r.Client().ZAdd(t.Context(), "joining2:{~fleet}:instances", redis.Z{Score: float64(now.UnixMicro()), Member: "other"})
	if !waitFor(15*time.Second, func() bool { return h2.instances() == 2 && h2.local.joining.Load() != 0 }) {
		t.Fatalf("N = %d, joining %v; want 2 and joining", h2.instances(), h2.local.joining.Load() != 0)
	}
	r.Pause()
	defer r.Resume()
	if passed, statuses := countPassed(h2, "192.0.2.70", 3); passed != 0 || statuses[http.StatusServiceUnavailable] != 3 {
		t.Errorf("joining, Redis unreachable: %d of 3 admitted (%v), want 3 × 503", passed, statuses)
	}
}

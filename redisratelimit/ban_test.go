package redisratelimit

import (
	"context"
	"encoding/binary"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
)

// TestRateLimitBanNever: bad input, a cost above a
// rate's n, dry_run, and requests that wait holds and admits never ban; a
// rejection by the quota does (the control).
func TestRateLimitBanNever(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	ctx := context.Background()
	banned := func(h *RedisRateLimit, id string) bool {
		t.Helper()
		n, err := r.Client().Exists(ctx, h.limit.BanKey(id)).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	costOf := func(v string) func(*http.Request, *caddy.Replacer) {
		return func(_ *http.Request, repl *caddy.Replacer) { repl.Set("cost", v) }
	}
	base := func(h *RedisRateLimit) {
		h.Rates = []Rate{{Requests: 2, Window: caddy.Duration(time.Minute)}}
		h.Ban = caddy.Duration(time.Minute)
	}

	t.Run("control", func(t *testing.T) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) { base(h); h.Prefix = "ctl:" })
		for i := 0; i < 3; i++ {
			serveRL(h, "192.0.2.1", nil)
		}
		if !banned(h, "192.0.2.1") {
			t.Fatal("a rejection by the quota started no ban")
		}
	})
	t.Run("every plan", func(t *testing.T) {
		// A ban is the key's, whatever plan its rates render to; a second
		// plan's request is refused from the deny cache, without Redis.
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			base(h)
			h.Prefix = "plan:"
			h.Rates = []Rate{mustRate("{plan}", "1m")}
		})
		plan := func(v string) func(*http.Request, *caddy.Replacer) {
			return func(_ *http.Request, repl *caddy.Replacer) { repl.Set("plan", v) }
		}
		for i := 0; i < 3; i++ {
			serveRL(h, "192.0.2.5", plan("2"))
		}
		if !banned(h, "192.0.2.5") {
			t.Fatal("a rejection by a plan's quota started no ban")
		}
		calls := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		for i := 0; i < 2; i++ {
			if a := serveRL(h, "192.0.2.5", plan("100")); a.passed || a.status != http.StatusTooManyRequests || a.retryAfter() < 50 {
				t.Fatalf("another plan's request %d during the ban: %d Retry-After %d, want 429 with the ban's end", i, a.status, a.retryAfter())
			}
		}
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - calls; got != 0 {
			t.Fatalf("%d script calls for requests of another plan during a ban this instance knows, want 0 (the deny cache)", got)
		}
	})
	t.Run("dry_run", func(t *testing.T) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) { base(h); h.Prefix = "dry:"; h.DryRun = true })
		for i := 0; i < 5; i++ {
			if a := serveRL(h, "192.0.2.2", nil); !a.passed {
				t.Fatalf("dry run request %d: %d", i, a.status)
			}
		}
		if banned(h, "192.0.2.2") {
			t.Fatal("dry_run banned a key")
		}
	})
	t.Run("bad cost and cost above n", func(t *testing.T) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) { base(h); h.Prefix = "cost:"; h.Cost = "{cost}" })
		if a := serveRL(h, "192.0.2.3", costOf("x")); a.status != http.StatusBadRequest {
			t.Fatalf("bad cost: %d, want 400", a.status)
		}
		if a := serveRL(h, "192.0.2.3", costOf("3")); a.status != http.StatusTooManyRequests {
			t.Fatalf("cost above n: %d, want 429", a.status)
		}
		if banned(h, "192.0.2.3") {
			t.Fatal("bad input or a cost above n banned a key")
		}
		if a := serveRL(h, "192.0.2.3", costOf("1")); !a.passed {
			t.Fatalf("a request of cost 1 after them: %d, want admitted", a.status)
		}
	})
	t.Run("wait", func(t *testing.T) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			base(h)
			h.Prefix = "wait:"
			h.Rates = []Rate{{Requests: 2, Window: caddy.Duration(time.Second)}}
			h.Wait = caddy.Duration(5 * time.Second)
		})
		for i := 0; i < 3; i++ {
			if a := serveRLWith(ctx, h, "192.0.2.4", nil, func(http.ResponseWriter, *http.Request) error { return nil }); !a.passed {
				t.Fatalf("request %d within what wait absorbs: %d", i, a.status)
			}
		}
		if banned(h, "192.0.2.4") {
			t.Fatal("a request that wait held and admitted banned its key")
		}
	})
}

// TestRateLimitBanValidation: ban must be positive and at least 1ms.
func TestRateLimitBanValidation(t *testing.T) {
	t.Parallel()
	for _, ban := range []time.Duration{-time.Second, time.Microsecond} {
		h := &RedisRateLimit{Rates: []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}, Ban: caddy.Duration(ban)}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "redis_ratelimit: ban") {
			t.Errorf("ban %s: %v, want an error naming redis_ratelimit: ban", ban, err)
		}
	}
}

// TestRateLimitBanRetryAfterNotEarly: a ban shorter than the quota's wait
// reports the quota's wait (Retry-After never earlier than the moment the
// request would be admitted), when the ban starts and
// while it lasts; a ban longer than the window reports in RateLimit's t=
// the ban's end, not the window's.
func TestRateLimitBanRetryAfterNotEarly(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	short := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Prefix = "ban-short:"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Hour)}}
		h.Ban = caddy.Duration(2 * time.Second)
	})
	serveRL(short, "10.0.0.4", nil)
	for i, when := range []string{"as the ban starts", "during the ban"} {
		a := serveRL(short, "10.0.0.4", nil)
		ra, _ := strconv.Atoi(a.header.Get("Retry-After"))
		if a.status != 429 || ra < 3500 {
			t.Errorf("%s (%d): %d Retry-After %q; want 429 and about an hour (the quota's wait), not the ban's 2 s", when, i, a.status, a.header.Get("Retry-After"))
		}
	}

	long := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Prefix = "ban-long:"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}
		h.Ban = caddy.Duration(time.Hour)
	})
	serveRL(long, "10.0.0.5", nil)
	for _, when := range []string{"as the ban starts", "during the ban"} {
		a := serveRL(long, "10.0.0.5", nil)
		var reset int
		if _, after, ok := strings.Cut(a.header.Get("RateLimit"), ";t="); ok {
			reset, _ = strconv.Atoi(after)
		}
		if a.status != 429 || reset < 3500 || a.header.Get("Retry-After") != strconv.Itoa(reset) {
			t.Errorf("%s: %d RateLimit %q Retry-After %q; want t= the ban's end (about 3600), as Retry-After", when, a.status, a.header.Get("RateLimit"), a.header.Get("Retry-After"))
		}
	}
}

// TestRateLimitSharedKeyOtherWait: two handlers share a key's state and
// differ in wait. While the one with a wait holds a request until later
// (its admission is recorded at that moment), the other's request cannot
// be recorded before it: it gets 429 with a Retry-After for then, like a
// quota's rejection, and never the fail policy (no pass without counting,
// no 503), and it starts no ban, since no quota rejected it.
func TestRateLimitSharedKeyOtherWait(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, mode := range []string{"fail open", "fail_closed", "ban"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			b, held := holdAhead(t, r, context.Background(), "shared-"+strings.ReplaceAll(mode, " ", "-")+":", "10.0.0.1", func(h *RedisRateLimit) {
				switch mode {
				case "fail_closed":
					h.FailClosed = true
				case "ban":
					h.Ban = caddy.Duration(time.Minute)
				}
			})
			for i := 0; i < 3; i++ {
				x := serveRL(b, "10.0.0.1", nil)
				ra, _ := strconv.Atoi(x.header.Get("Retry-After"))
				if x.status != 429 || x.passed || ra < 1 {
					t.Errorf("b's request %d while a holds one: %d passed %v Retry-After %q err %v; want 429 with a Retry-After", i, x.status, x.passed, x.header.Get("Retry-After"), x.err)
				}
			}
			if n := counterValue(t, b.counters[shared.ResultError]); n != 0 {
				t.Errorf("b counted %v errors: the fail policy answered", n)
			}
			if a := <-held; !a.passed {
				t.Fatalf("a's held request: %d", a.status)
			}
			if x := serveRL(b, "10.0.0.1", nil); !x.passed {
				t.Errorf("b after a's hold: %d %v; want it admitted (and never banned)", x.status, x.err)
			}
		})
	}
}

// TestRateLimitDenyCacheOffWithWait: with wait, a held client that goes
// away gives its slot back, on any instance, so a rejection is never known
// to last: rejected requests ask Redis (answered from memory only when
// that can only be stricter elsewhere, so still exact).
// A ban is still answered from memory.
func TestRateLimitDenyCacheOffWithWait(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Prefix = "deny-wait:"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}
		h.Wait = caddy.Duration(time.Second)
	})
	serveRL(h, "10.0.0.6", nil)
	serveRL(h, "10.0.0.6", nil) // rejected: beyond what wait absorbs
	before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
	for i := 0; i < 3; i++ {
		if a := serveRL(h, "10.0.0.6", nil); a.status != 429 {
			t.Fatalf("request %d: %d, want 429", i, a.status)
		}
	}
	if n := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; n != 3 {
		t.Errorf("%d script calls for 3 rejected requests with wait, want 3 (no deny cache)", n)
	}
}

// TestRateLimitClientGoneDuringDecision: a client that goes away while its
// decision is on its way to Redis, and would have been held, uses no quota:
// its admission is given back once the answer comes, so
// the next request gets that slot.
func TestRateLimitClientGoneDuringDecision(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Prefix = "gone:"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}
		h.Wait = caddy.Duration(5 * time.Second)
		h.Timeout = caddy.Duration(5 * time.Second)
	})
	const ip = "10.0.0.7"
	if a := serveRL(h, ip, nil); !a.passed {
		t.Fatalf("first request: %d", a.status)
	}
	first := time.Now() // its slot is taken until about a second from now
	scripts := func() int64 { return r.CommandCalls("evalsha") + r.CommandCalls("eval") }
	before := scripts()
	r.Pause()
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan rlAnswer, 1)
	go func() { gone <- serveRLWith(ctx, h, ip, nil, nil) }()
	time.Sleep(500 * time.Millisecond) // its call on its way to the paused Redis
	cancel()
	if a := <-gone; a.passed || a.status != statusClientClosedRequest {
		t.Fatalf("the request whose client went away: %d passed %v, want 499", a.status, a.passed)
	}
	r.Resume() // the decision runs now: held until the slot after the first
	if !waitFor(10*time.Second, func() bool { return scripts() >= before+2 }) {
		t.Fatalf("%d script calls since the first request, want the gone client's decision and the return of its admission", scripts()-before)
	}
	b := serveRL(h, ip, nil)
	if !b.passed {
		t.Fatalf("next request: %d %v", b.status, b.err)
	}
	// Given back, its slot (a second after the first) is the next
	// request's; kept, the next would wait until two seconds after it.
	if end := time.Since(first); end > 1700*time.Millisecond {
		t.Errorf("the next request passed %s after the first, want about 1 s: the gone client's admission was kept", end)
	}
}

// TestRateLimitBanCacheEndsWithTheBan: a ban whose Retry-After is later
// than the ban's end (the quota that started it admits that request only
// later) is answered from the deny cache only until the ban ends, on the
// instance that started it and on one that met it under way: then a
// cheaper request the quota admits passes.
func TestRateLimitBanCacheEndsWithTheBan(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	mk := func() *RedisRateLimit {
		return newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Prefix = "ban-cache:"
			h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(time.Hour)}}
			h.Ban = caddy.Duration(time.Second)
			h.Cost = "{http.request.header.X-Cost}"
		})
	}
	started, met := mk(), mk()
	started.Name, met.Name = "started", "met"
	cost := func(c string) func(*http.Request, *caddy.Replacer) {
		return func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-Cost", c) }
	}
	const ip = "10.9.9.9"
	if x := serveRL(started, ip, cost("1")); !x.passed {
		t.Fatalf("first: %d", x.status)
	}
	if x := serveRL(started, ip, cost("3")); x.status != 429 {
		t.Fatalf("cost 3: %d, want 429 (and a ban)", x.status)
	}
	if x := serveRL(met, ip, cost("1")); x.status != 429 || x.header.Get("Retry-After") == "1" {
		t.Fatalf("under the ban, the other instance: %d Retry-After %q, want 429 and the quota's wait", x.status, x.header.Get("Retry-After"))
	}
	time.Sleep(1500 * time.Millisecond)                 // the ban is over
	for _, h := range []*RedisRateLimit{started, met} { // two units are left
		if x := serveRL(h, ip, cost("1")); !x.passed {
			t.Errorf("after the ban, instance %s: %d Retry-After %q; want a cost-1 request admitted", h.Name, x.status, x.header.Get("Retry-After"))
		}
	}
}

// TestRateLimitOrderRejectionNotCached: a rejection only a log's order
// made (another handler holds an admission until later) is not kept in the
// deny cache: once the held client goes away and its slot is given back,
// the next request passes.
func TestRateLimitOrderRejectionNotCached(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	const ip = "10.0.0.8"
	ctx, cancel := context.WithCancel(context.Background())
	b, held := holdAhead(t, r, ctx, "order-cache:", ip, nil)
	if x := serveRL(b, ip, nil); x.status != 429 {
		t.Fatalf("b while a holds a request: %d, want 429", x.status)
	}
	cancel() // a's held client goes away: its slot is given back
	if x := <-held; x.status != statusClientClosedRequest {
		t.Fatalf("a's held request: %d, want 499", x.status)
	}
	// Kept, b's rejection would last until a's slot, about 3 s ahead.
	if !waitFor(500*time.Millisecond, func() bool { return serveRL(b, ip, nil).passed }) {
		t.Fatal("b was still rejected after a's held slot was given back (from its deny cache)")
	}
}

// holdAhead provisions two handlers sharing prefix: a, with a rate of 2 per
// 3 s and a wait, and b, without (mod changes it further). a admits two
// requests of ip and holds a third (its client's context ctx) until its
// slot, about 3 s ahead; held gets its answer. It returns once that third
// request is recorded ahead.
func holdAhead(t *testing.T, r *testRedis, ctx context.Context, prefix, ip string, mod func(*RedisRateLimit)) (b *RedisRateLimit, held <-chan rlAnswer) {
	t.Helper()
	a := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Name, h.Prefix = "a", prefix
		h.Rates = []Rate{{Requests: 100, Window: caddy.Duration(time.Minute)}, {Requests: 2, Window: caddy.Duration(3 * time.Second)}}
		h.Wait = caddy.Duration(5 * time.Second)
	})
	b = newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Name, h.Prefix = "b", prefix
		h.Rates = []Rate{{Requests: 100, Window: caddy.Duration(time.Minute)}}
		if mod != nil {
			mod(h)
		}
	})
	serveRL(a, ip, nil)
	serveRL(a, ip, nil)
	ch := make(chan rlAnswer, 1)
	go func() { ch <- serveRLWith(ctx, a, ip, nil, nil) }()
	waitHeldAhead(t, r, prefix)
	return b, ch
}

// waitHeldAhead waits until a sliding_window log under prefix records an
// admission ahead of Redis TIME (a request held until its slot).
func waitHeldAhead(t *testing.T, r *testRedis, prefix string) {
	t.Helper()
	c := r.Client()
	ok := waitFor(10*time.Second, func() bool {
		keys, _ := c.Keys(context.Background(), prefix+"*").Result()
		now, err := c.Time(context.Background()).Result()
		if err != nil {
			return false
		}
		for _, k := range keys {
			v, _ := c.GetRange(context.Background(), k, 16, 23).Result()
			if len(v) == 8 && math.Float64frombits(binary.BigEndian.Uint64([]byte(v))) > float64(now.UnixMicro()) {
				return true
			}
		}
		return false
	})
	if !ok {
		t.Fatal("no request was held ahead")
	}
}

// TestRateLimitHeldAdmissionRejectionNotCached: a quota's rejection that
// an admission another handler holds until later makes longer is not kept
// in the deny cache: once the held client goes away, the request passes
// when its quota allows it without that admission. The held one is the
// latest of a log both share (it orders b's request after it), or the slot
// b's quota counts.
func TestRateLimitHeldAdmissionRejectionNotCached(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	per := func(n int, w time.Duration) Rate { return Rate{Requests: n, Window: caddy.Duration(w)} }
	for _, tc := range []struct {
		name         string
		ratesA       []Rate // a holds its third request of the key (wait 5s)
		ratesB       []Rate
		passedWithin time.Duration // kept, the rejection would last about a second longer
	}{
		{"latest of a shared log", []Rate{per(100, time.Minute), per(2, 3*time.Second)}, []Rate{per(100, time.Minute), per(1, time.Second)}, 2 * time.Second},
		{"the slot the quota counts", []Rate{per(1, time.Second)}, []Rate{per(1, time.Second)}, 1500 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			prefix, ip := "held-"+strings.ReplaceAll(tc.name, " ", "-")+":", "10.0.0.9"
			a := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.Name, h.Prefix, h.Rates, h.Wait = "a", prefix, tc.ratesA, caddy.Duration(5*time.Second)
			})
			b := newRateLimit(t, r, func(h *RedisRateLimit) { h.Name, h.Prefix, h.Rates = "b", prefix, tc.ratesB })
			if len(tc.ratesA) > 1 { // a's 2 per 3 s used, so its next request is held
				serveRL(a, ip, nil)
				serveRL(a, ip, nil)
			}
			if x := serveRL(b, ip, nil); !x.passed { // b's 1 per second used
				t.Fatalf("b's first request: %d", x.status)
			}
			ctx, cancel := context.WithCancel(context.Background())
			held := make(chan rlAnswer, 1)
			go func() { held <- serveRLWith(ctx, a, ip, nil, nil) }()
			waitHeldAhead(t, r, prefix)
			if x := serveRL(b, ip, nil); x.status != 429 {
				t.Fatalf("b while its quota and a's held request reject it: %d, want 429", x.status)
			}
			rejected := time.Now()
			cancel()
			<-held
			if !waitFor(tc.passedWithin, func() bool { return serveRL(b, ip, nil).passed }) {
				t.Fatalf("b still rejected %s after a's held admission was given back", time.Since(rejected))
			}
		})
	}
}

// TestRateLimitExceededOncePerPeriod: rate_limit_exceeded goes out once per
// key per rejection period also where the deny cache keeps no rejection
// (wait); an admin reset of the key starts a new period.
func TestRateLimitExceededOncePerPeriod(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Prefix = "announce:"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}
		h.Wait = caddy.Duration(time.Second)
	})
	d := decision{Wait: time.Minute} // a rejection Redis answered
	if h.remembers(d) {
		t.Fatal("under wait the deny cache keeps a rejection")
	}
	const id = "mallory"
	if !h.firstRejection(id, d) || h.firstRejection(id, d) {
		t.Fatal("want the first rejection of the period announced, the second not")
	}
	// What every instance does when a reset is announced (see resetQuota).
	resetForgetter{h.client}.Forget(h.Prefix, id)
	if !h.firstRejection(id, d) {
		t.Error("the first rejection after an admin reset was not announced")
	}
}

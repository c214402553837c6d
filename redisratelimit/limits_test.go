package redisratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func TestRateLimitSlidingBasic(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(10 * time.Second)}}
	})
	for i := 0; i < 3; i++ {
		a := serveRL(h, "192.0.2.1", nil)
		if !a.passed || a.err != nil {
			t.Fatalf("request %d: want admitted, got status %d err %v", i, a.status, a.err)
		}
		if _, rem, _ := rlState(t, a); rem != 2-i {
			t.Fatalf("request %d: remaining %d, want %d", i, rem, 2-i)
		}
	}
	a := serveRL(h, "192.0.2.1", nil)
	if a.passed || a.status != http.StatusTooManyRequests || !errors.Is(a.err, ErrRateLimited) {
		t.Fatalf("4th request: want 429 ErrRateLimited, got passed=%v status %d err %v", a.passed, a.status, a.err)
	}
	if ra := a.retryAfter(); ra < 9 || ra > 10 {
		t.Fatalf("Retry-After %d, want 9..10", ra)
	}
	if got := a.repl.ReplaceAll("{http.redis_ratelimit.remaining}/{http.redis_ratelimit.retry_after}", ""); got != "0/"+a.header.Get(HeaderRetryAfter) {
		t.Fatalf("placeholders %q", got)
	}
	// Another client has its own bucket.
	if a := serveRL(h, "192.0.2.2", nil); !a.passed {
		t.Fatalf("other client: want admitted, got %d", a.status)
	}
	// The key carries the hash tag and expires by itself.
	c := r.Client()
	ttl, err := c.PTTL(context.Background(), "caddy:rl:{192.0.2.1}:sw:3/10s").Result()
	if err != nil || ttl <= 0 || ttl > 10100*time.Millisecond {
		t.Fatalf("PTTL of the sliding key: %v %v", ttl, err)
	}
}

func TestRateLimitGCRABasic(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Algorithm = "gcra"
		h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(10 * time.Second)}} // one per second
		h.Burst = 3
	})
	for i := 0; i < 3; i++ {
		a := serveRL(h, "192.0.2.1", nil)
		if !a.passed {
			t.Fatalf("request %d within the burst: want admitted, got %d", i, a.status)
		}
		if _, rem, _ := rlState(t, a); rem != 2-i {
			t.Fatalf("request %d: remaining %d, want %d", i, rem, 2-i)
		}
	}
	a := serveRL(h, "192.0.2.1", nil)
	if a.passed || a.status != 429 {
		t.Fatalf("past the burst: want 429, got %d", a.status)
	}
	if ra := a.retryAfter(); ra != 1 {
		t.Fatalf("Retry-After %d, want 1 (one request per second)", ra)
	}
	ttl, err := r.Client().PTTL(context.Background(), "caddy:rl:{192.0.2.1}:gcra:10/10s:b3").Result()
	if err != nil || ttl <= 0 || ttl > 3100*time.Millisecond {
		t.Fatalf("PTTL of the gcra key: %v %v (want until the TAT, <= 3s)", ttl, err)
	}
}

// TestRateLimitHeaders checks the draft-10 fields item by item, on admitted
// and rejected answers, and that headers off sends none.
func TestRateLimitHeaders(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = []Rate{
			{Requests: 5, Window: caddy.Duration(time.Minute)},
			{Requests: 2, Window: caddy.Duration(1500 * time.Millisecond)},
			{Requests: 100, Window: caddy.Duration(time.Hour)},
		}
	})
	check := func(a rlAnswer, wantIdx, wantRem int, wantSecsMin, wantSecsMax int) {
		t.Helper()
		pol := a.header.Get(HeaderRateLimitPolicy)
		items := strings.Split(pol, ", ")
		want := [][3]int{{0, 5, 60}, {1, 2, 2}, {2, 100, 3600}}
		if len(items) != len(want) {
			t.Fatalf("RateLimit-Policy %q: want %d items", pol, len(want))
		}
		for i, it := range items {
			m := rlPolicyItem.FindStringSubmatch(it)
			if m == nil {
				t.Fatalf("policy item %q does not match %s", it, rlPolicyItem)
			}
			for f := 0; f < 3; f++ {
				if n, _ := strconv.Atoi(m[f+1]); n != want[i][f] {
					t.Fatalf("policy item %q: field %d is %d, want %d", it, f, n, want[i][f])
				}
			}
		}
		idx, rem, secs := rlState(t, a)
		if idx != wantIdx || rem != wantRem || secs < wantSecsMin || secs > wantSecsMax {
			t.Fatalf("RateLimit %q: want r%d r=%d t in [%d,%d]", a.header.Get(HeaderRateLimit), wantIdx, wantRem, wantSecsMin, wantSecsMax)
		}
	}
	a := serveRL(h, "192.0.2.9", nil)
	check(a, 1, 1, 1, 2) // the 2-per-1.5s rate is the tightest
	a = serveRL(h, "192.0.2.9", nil)
	check(a, 1, 0, 1, 2)
	a = serveRL(h, "192.0.2.9", nil)
	if a.passed {
		t.Fatal("third request within 1.5s admitted")
	}
	check(a, 1, 0, 1, 2)
	if a.retryAfter() < 1 || a.retryAfter() > 2 {
		t.Fatalf("Retry-After %d", a.retryAfter())
	}

	off := false
	h2 := newRateLimit(t, r, func(h *RedisRateLimit) { h.Headers = &off; h.Prefix = "other:" })
	a = serveRL(h2, "192.0.2.9", nil)
	if a.header.Get(HeaderRateLimit) != "" || a.header.Get(HeaderRateLimitPolicy) != "" {
		t.Fatalf("headers off: got %v", a.header)
	}
}

// TestRateLimitRejectChargesNothing: a request rejected by one rate uses no
// quota of the other rate (both algorithms), and writes nothing.
func TestRateLimitRejectChargesNothing(t *testing.T) {
	t.Parallel()
	for _, algo := range []string{"sliding_window", "gcra"} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			h := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.Algorithm = algo
				h.Rates = []Rate{
					{Requests: 2, Window: caddy.Duration(time.Second)},
					{Requests: 3, Window: caddy.Duration(time.Minute)},
				}
			})
			for i := 0; i < 2; i++ {
				if a := serveRL(h, "192.0.2.3", nil); !a.passed {
					t.Fatalf("request %d: want admitted", i)
				}
			}
			before, _ := r.Client().Dump(context.Background(), rateKey(h, "192.0.2.3", 1)).Result()
			for i := 0; i < 10; i++ {
				if a := serveRL(h, "192.0.2.3", nil); a.passed {
					t.Fatalf("request %d past the per-second rate admitted", i)
				}
			}
			h.deny = h.newDenyCache() // ask Redis, not memory, below
			for i := 0; i < 3; i++ {
				if a := serveRL(h, "192.0.2.3", nil); a.passed {
					t.Fatalf("request %d past the per-second rate admitted", i)
				}
			}
			after, _ := r.Client().Dump(context.Background(), rateKey(h, "192.0.2.3", 1)).Result()
			if before != after {
				t.Fatal("rejected requests changed the state of the other rate")
			}
			// Both rates count only the 2 admitted requests: after a second
			// the per-minute rate (3) has room for exactly one more.
			time.Sleep(1100 * time.Millisecond)
			h.deny = h.newDenyCache()
			if a := serveRL(h, "192.0.2.3", nil); !a.passed {
				t.Fatalf("third request after the per-second window: want admitted by both rates, got %d (RateLimit %q)", a.status, a.header.Get(HeaderRateLimit))
			}
			time.Sleep(1100 * time.Millisecond)
			a := serveRL(h, "192.0.2.3", nil)
			if a.passed {
				t.Fatal("fourth request admitted past the per-minute rate")
			}
			if idx, _, _ := rlState(t, a); idx != 1 {
				t.Fatalf("rejected by r%d, want r1", idx)
			}
		})
	}
}

// rateKey is the Redis key of rate i of h's static plan for id.
func rateKey(h *RedisRateLimit, id string, i int) string {
	return h.limit.LocalRates(id, h.static.Plan)[i].Key
}

// TestRateLimitRetryAfterExact: a retry at exactly Retry-After (after the
// answer) is admitted.
func TestRateLimitRetryAfterExact(t *testing.T) {
	t.Parallel()
	for _, algo := range []string{"sliding_window", "gcra"} {
		t.Run(algo, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			h := newRateLimit(t, r, func(h *RedisRateLimit) {
				h.Algorithm = algo
				h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}
			})
			for round := 0; round < 2; round++ {
				if a := serveRL(h, "192.0.2.4", nil); !a.passed {
					t.Fatalf("round %d: first request: want admitted, got %d", round, a.status)
				}
				a := serveRL(h, "192.0.2.4", nil)
				if a.passed {
					t.Fatalf("round %d: second request admitted", round)
				}
				ra := a.retryAfter()
				if ra != 1 {
					t.Fatalf("round %d: Retry-After %d, want 1 (ceil of just under 1s)", round, ra)
				}
				// Retrying early stays rejected (from the deny cache or Redis).
				if a := serveRL(h, "192.0.2.4", nil); a.passed {
					t.Fatalf("round %d: early retry admitted", round)
				}
				time.Sleep(time.Duration(ra) * time.Second)
				if a := serveRL(h, "192.0.2.4", nil); !a.passed {
					t.Fatalf("round %d: retry at Retry-After rejected (Retry-After %s)", round, a.header.Get(HeaderRetryAfter))
				}
				time.Sleep(1100 * time.Millisecond)
			}
		})
	}
}

// TestRateLimitDryRun: dry_run never rejects, reports what enforcement
// would do (headers, placeholders, metrics) and records only the requests
// enforcement would admit.
func TestRateLimitDryRun(t *testing.T) {
	r := startRedis(t) // not parallel: reads the process-wide counter
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.DryRun = true
		h.Rates = []Rate{{Requests: 2, Window: caddy.Duration(time.Minute)}}
	})
	denied0 := rlCounterValue(h.counters[shared.ResultDenied])
	allowed0 := rlCounterValue(h.counters[shared.ResultAllowed])
	for i := 0; i < 6; i++ {
		a := serveRL(h, "192.0.2.5", nil)
		if !a.passed || a.err != nil {
			t.Fatalf("dry run request %d: not passed (%d, %v)", i, a.status, a.err)
		}
		_, rem, secs := rlState(t, a)
		wantRA := "0"
		if i >= 2 {
			wantRA = a.repl.ReplaceAll("{http.redis_ratelimit.retry_after}", "")
			if n, _ := strconv.Atoi(wantRA); n < 59 || n > 60 || rem != 0 || secs < 59 {
				t.Fatalf("dry run request %d: would-reject not reported: retry_after %q, RateLimit %q", i, wantRA, a.header.Get(HeaderRateLimit))
			}
		} else if rem != 1-i {
			t.Fatalf("dry run request %d: remaining %d", i, rem)
		}
		if got := a.repl.ReplaceAll("{http.redis_ratelimit.retry_after}", ""); got != wantRA {
			t.Fatalf("retry_after placeholder %q", got)
		}
		if a.header.Get(HeaderRetryAfter) != "" {
			t.Fatal("dry run sent Retry-After")
		}
	}
	if d := rlCounterValue(h.counters[shared.ResultDenied]) - denied0; d != 4 {
		t.Fatalf("denied counter grew by %v, want 4", d)
	}
	if d := rlCounterValue(h.counters[shared.ResultAllowed]) - allowed0; d != 2 {
		t.Fatalf("allowed counter grew by %v, want 2", d)
	}
	if pos := rlRingCount(t, r, "caddy:rl:{192.0.2.5}:sw:2/1m0s"); pos != 2 {
		t.Fatalf("Redis recorded %d admissions, want 2", pos)
	}
}

// TestRateLimitDenyCacheNoRedis: while a key is known to be rejected, its
// requests are answered without any Redis call.
func TestRateLimitDenyCacheNoRedis(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}
	})
	if a := serveRL(h, "192.0.2.6", nil); !a.passed {
		t.Fatal("first request rejected")
	}
	if a := serveRL(h, "192.0.2.6", nil); a.passed {
		t.Fatal("second request admitted")
	}
	calls := r.CommandCalls("evalsha") + r.CommandCalls("eval")
	for i := 0; i < 50; i++ {
		a := serveRL(h, "192.0.2.6", nil)
		if a.passed || a.status != 429 {
			t.Fatalf("cached rejection %d: got %d", i, a.status)
		}
		if ra := a.retryAfter(); ra < 59 || ra > 60 {
			t.Fatalf("cached rejection Retry-After %d", ra)
		}
		if idx, rem, _ := rlState(t, a); idx != 0 || rem != 0 {
			t.Fatalf("cached rejection RateLimit %q", a.header.Get(HeaderRateLimit))
		}
	}
	if got := r.CommandCalls("evalsha") + r.CommandCalls("eval"); got != calls {
		t.Fatalf("deny cache made %d script calls, want 0", got-calls)
	}
	// Another key still goes to Redis.
	if a := serveRL(h, "192.0.2.7", nil); !a.passed {
		t.Fatal("other key rejected")
	}
	if got := r.CommandCalls("evalsha") + r.CommandCalls("eval"); got != calls+1 {
		t.Fatalf("other key: %d script calls, want 1", got-calls)
	}
}

// TestRateLimitUsesRedisTime: decisions follow Redis TIME, not the Caddy
// host's clock: a TAT set from Redis time decides the Retry-After, with the
// handler's local clock skewed by hours either way.
func TestRateLimitUsesRedisTime(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	c := r.Client()
	for _, skew := range []time.Duration{-3 * time.Hour, 3 * time.Hour} {
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Algorithm = "gcra"
			h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(10 * time.Second)}}
			h.now = func() time.Time { return time.Now().Add(skew) }
		})
		rt, err := c.Time(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		tat := rt.UnixMicro() + 5_000_000 // burst 1: passes when Redis time reaches the TAT, in 5s
		if err := c.Set(context.Background(), "caddy:rl:{192.0.2.8}:gcra:1/10s:b1", tat, time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
		a := serveRL(h, "192.0.2.8", nil)
		if a.passed {
			t.Fatalf("skew %s: admitted", skew)
		}
		if ra := a.retryAfter(); ra < 4 || ra > 5 {
			t.Fatalf("skew %s: Retry-After %d, want 5 (from Redis TIME)", skew, ra)
		}
		// The deny cache (local clock) holds with the skew, too.
		if a := serveRL(h, "192.0.2.8", nil); a.passed || a.retryAfter() < 4 || a.retryAfter() > 5 {
			t.Fatalf("skew %s: cached answer %d Retry-After %d", skew, a.status, a.retryAfter())
		}
		if err := c.Del(context.Background(), "caddy:rl:{192.0.2.8}:gcra:1/10s:b1").Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRateLimitKeys: templates, the empty-render and unknown-placeholder
// fallbacks to the client IP (warned once), long keys and braces.
func TestRateLimitKeys(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	c := r.Client()
	exists := func(key string) bool {
		n, err := c.Exists(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n == 1
	}

	t.Run("header", func(t *testing.T) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) { h.Key = "{header.X-User}"; h.Prefix = "hdr:" })
		serveRL(h, "192.0.2.10", func(r *http.Request, _ *caddy.Replacer) { r.Header.Set("X-User", "alice") })
		if !exists("hdr:{alice}:sw:5/1s") {
			t.Fatal("no key for alice")
		}
		serveRL(h, "192.0.2.10", nil) // header missing: renders empty
		if !exists("hdr:{ip/192.0.2.10}:sw:5/1s") {
			t.Fatal("empty render did not fall back to the client IP")
		}
		serveRL(h, "192.0.2.10", func(r *http.Request, _ *caddy.Replacer) { r.Header.Set("X-User", "ip/192.0.2.11") })
		if exists("hdr:{ip/192.0.2.11}:sw:5/1s") {
			t.Fatal("a client could pick another client's fallback bucket")
		}
		long := strings.Repeat("x", 201)
		serveRL(h, "192.0.2.10", func(r *http.Request, _ *caddy.Replacer) { r.Header.Set("X-User", long) })
		keys, _ := c.Keys(context.Background(), "hdr:{sha256:*").Result()
		if len(keys) != 2 { // the long key and the "ip/" one
			t.Fatalf("hashed keys %v, want 2", keys)
		}
		serveRL(h, "192.0.2.10", func(r *http.Request, _ *caddy.Replacer) { r.Header.Set("X-User", "a}b{c") })
		if keys, _ := c.Keys(context.Background(), "hdr:{sha256:*").Result(); len(keys) != 3 {
			t.Fatalf("a key with braces was not hashed: %v", keys)
		}
	})

	t.Run("unknown placeholder", func(t *testing.T) {
		core, logs := observer.New(zapcore.WarnLevel)
		h := newRateLimit(t, r, func(h *RedisRateLimit) { h.Key = "{http.auth.user.id}"; h.Prefix = "auth:" })
		h.logger = zap.New(core)
		for i := 0; i < 3; i++ {
			serveRL(h, "192.0.2.12", nil)
		}
		if !exists("auth:{ip/192.0.2.12}:sw:5/1s") {
			t.Fatal("unknown placeholder did not fall back to the client IP")
		}
		if n := logs.FilterMessageSnippet("unknown").Len(); n != 1 {
			t.Fatalf("%d warnings about the unknown placeholder, want 1", n)
		}
		serveRL(h, "192.0.2.12", func(_ *http.Request, repl *caddy.Replacer) { repl.Set("http.auth.user.id", "bob") })
		if !exists("auth:{bob}:sw:5/1s") {
			t.Fatal("no key for the authenticated user")
		}
	})

	t.Run("client_ip shorthand", func(t *testing.T) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) { h.Key = "{client_ip}"; h.Prefix = "sh:" })
		serveRL(h, "192.0.2.13", nil)
		h2 := newRateLimit(t, r, func(h *RedisRateLimit) { h.Prefix = "def:" })
		serveRL(h2, "192.0.2.13", nil)
		if !exists("sh:{192.0.2.13}:sw:5/1s") || !exists("def:{192.0.2.13}:sw:5/1s") {
			t.Fatal("{client_ip} / default key did not render the client IP")
		}
	})
}

// TestRateLimitConfigErrors: JSON configs skip the Caddyfile parser, so
// Provision/Validate must reject bad values themselves, naming the field.
func TestRateLimitConfigErrors(t *testing.T) {
	t.Parallel()
	sec := caddy.Duration(time.Second)
	for _, tc := range []struct {
		name string
		h    RedisRateLimit
		want string
	}{
		{"no rate", RedisRateLimit{}, "rate"},
		{"zero requests", RedisRateLimit{Rates: []Rate{{Requests: 0, Window: sec}}}, "rate 0"},
		{"zero window", RedisRateLimit{Rates: []Rate{{Requests: 1, Window: 0}}}, "window"},
		{"sub-ms window", RedisRateLimit{Rates: []Rate{{Requests: 1, Window: caddy.Duration(time.Microsecond)}}}, "window"},
		{"sliding too large", RedisRateLimit{Rates: []Rate{{Requests: MaxSlidingWindowRequests + 1, Window: sec}}}, "gcra"},
		{"gcra too fast", RedisRateLimit{Algorithm: "gcra", Rates: []Rate{{Requests: 2000, Window: caddy.Duration(time.Millisecond)}}}, "microsecond"},
		{"bad algorithm", RedisRateLimit{Algorithm: "leaky", Rates: []Rate{{Requests: 1, Window: sec}}}, "algorithm"},
		{"burst without gcra", RedisRateLimit{Burst: 3, Rates: []Rate{{Requests: 1, Window: sec}}}, "burst"},
		{"negative burst", RedisRateLimit{Algorithm: "gcra", Burst: -1, Rates: []Rate{{Requests: 1, Window: sec}}}, "burst"},
		{"status", RedisRateLimit{Status: 302, Rates: []Rate{{Requests: 1, Window: sec}}}, "status"},
		{"prefix", RedisRateLimit{Prefix: "a{b}", Rates: []Rate{{Requests: 1, Window: sec}}}, "prefix"},
		{"unknown namespace", RedisRateLimit{Key: "{foo}", Rates: []Rate{{Requests: 1, Window: sec}}}, "{foo}"},
		{"two servers", RedisRateLimit{Rates: []Rate{{Requests: 1, Window: sec}}, RedisConfig: shared.RedisConfig{Addresses: []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}}}, "exactly one"},
		{"bad address", RedisRateLimit{Rates: []Rate{{Requests: 1, Window: sec}}, RedisConfig: shared.RedisConfig{Addresses: []string{"localhost"}}}, "address"},
		{"cost zero", RedisRateLimit{Cost: "0", Rates: []Rate{{Requests: 1, Window: sec}}}, "cost"},
		{"cost word", RedisRateLimit{Cost: "two", Rates: []Rate{{Requests: 1, Window: sec}}}, "cost"},
		{"count status", RedisRateLimit{Count: []string{"401", "99"}, Rates: []Rate{{Requests: 1, Window: sec}}}, "count"},
		{"count class", RedisRateLimit{Count: []string{"0xx"}, Rates: []Rate{{Requests: 1, Window: sec}}}, "count"},
		{"wait negative", RedisRateLimit{Wait: caddy.Duration(-time.Second), Rates: []Rate{{Requests: 1, Window: sec}}}, "wait"},
		{"mixed", RedisRateLimit{Rates: []Rate{{Requests: 1, Window: sec}}, RedisConfig: shared.RedisConfig{Addresses: []string{"127.0.0.1:1"}, Cluster: []string{"127.0.0.1:2"}}}, "mutually exclusive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.h
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			err := h.Provision(ctx)
			defer h.Cleanup()
			if err == nil {
				t.Fatal("Provision accepted the config")
			}
			if !strings.Contains(err.Error(), "redis_ratelimit") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q should name redis_ratelimit and %q", err, tc.want)
			}
			if h.clientKey != "" {
				t.Fatal("a failed Provision kept a pooled client")
			}
		})
	}
}

// TestRateLimitCleanupStopsBatcher: the last Cleanup stops the batcher
// workers; a fresh Provision works again.
func TestRateLimitCleanupStopsBatcher(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	mk := func() (*RedisRateLimit, func()) {
		return newRateLimitScoped(t, r, func(h *RedisRateLimit) {
			h.Timeout = caddy.Duration(777 * time.Millisecond) // a client of its own
		})
	}
	h1, cleanup1 := mk()
	h2, cleanup2 := mk()
	if h1.client != h2.client {
		t.Fatal("handlers with the same settings do not share a client")
	}
	if h1.client.Batcher() != nil {
		t.Fatal("a batcher was started before the first decision")
	}
	if a := serveRL(h1, "192.0.2.20", nil); !a.passed {
		t.Fatal("first decision failed")
	}
	b := h1.client.Batcher()
	if b == nil || h2.client.Batcher() != b {
		t.Fatal("handlers with the same settings do not share a batcher")
	}
	cleanup1()
	select {
	case <-b.Stopped():
		t.Fatal("batcher stopped while a handler still uses it")
	default:
	}
	if a := serveRL(h2, "192.0.2.20", nil); !a.passed {
		t.Fatal("second handler stopped working after the first one's Cleanup")
	}
	cleanup2()
	// It serves requests of the old config still on their way for
	// destructGrace, then stops.
	select {
	case <-b.Stopped():
		t.Fatal("batcher stopped at once: a request of the old config on its way would fail")
	default:
	}
	select {
	case <-b.Stopped():
	case <-time.After(shared.DestructGrace + 5*time.Second):
		t.Fatal("batcher still running after the last Cleanup and the grace")
	}
	h3, _ := mk()
	if a := serveRL(h3, "192.0.2.20", nil); !a.passed || a.err != nil {
		t.Fatalf("after re-provisioning: %d %v", a.status, a.err)
	}
	if h3.client.Batcher() == b {
		t.Fatal("a stopped batcher was reused")
	}
}

// TestRateLimitConcurrentDistinctKeys: many keys at once through the
// batcher each get exactly their own quota (answers are not mixed up).
func TestRateLimitConcurrentDistinctKeys(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = []Rate{{Requests: 7, Window: caddy.Duration(time.Minute)}}
	})
	const keys, per = 20, 12
	var mu sync.Mutex
	admitted := map[string]int{}
	var wg sync.WaitGroup
	for k := 0; k < keys; k++ {
		for j := 0; j < per; j++ {
			wg.Add(1)
			go func(ip string) {
				defer wg.Done()
				if a := serveRL(h, ip, nil); a.passed {
					mu.Lock()
					admitted[ip]++
					mu.Unlock()
				} else if a.status != 429 {
					t.Errorf("%s: status %d err %v", ip, a.status, a.err)
				}
			}(fmt.Sprintf("198.51.100.%d", k))
		}
	}
	wg.Wait()
	for k := 0; k < keys; k++ {
		ip := fmt.Sprintf("198.51.100.%d", k)
		if admitted[ip] != 7 {
			t.Fatalf("%s: %d admitted, want 7", ip, admitted[ip])
		}
	}
}

// TestRateLimitSlidingRemaining: the remaining quota follows admissions
// leaving the window, both by stepping (few left) and by binary search
// (many left at once), and the log never exceeds n slots.
func TestRateLimitSlidingRemaining(t *testing.T) {
	// Not parallel: its sleeps step admissions out of a 2 s window, which
	// only works while the test is not starved by 15 others.
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(2 * time.Second)}}
	})
	send := func(k int, wantLastRem int) {
		t.Helper()
		var a rlAnswer
		for i := 0; i < k; i++ {
			if a = serveRL(h, "192.0.2.50", nil); !a.passed {
				t.Fatalf("request %d of %d rejected", i, k)
			}
		}
		if _, rem, _ := rlState(t, a); rem != wantLastRem {
			t.Fatalf("remaining %d, want %d (RateLimit %q)", rem, wantLastRem, a.header.Get(HeaderRateLimit))
		}
	}
	send(8, 2)                          // 8 in the window
	time.Sleep(2200 * time.Millisecond) // all 8 leave: more than the 4 steps, so binary search
	send(2, 8)
	time.Sleep(1200 * time.Millisecond)
	send(3, 5) // 5 in the window
	time.Sleep(1000 * time.Millisecond)
	send(1, 6) // the first 2 left (stepping): 3 + 1 in the window
	send(6, 0)
	if a := serveRL(h, "192.0.2.50", nil); a.passed {
		t.Fatal("11th request within the window admitted")
	}
	n, err := r.Client().StrLen(context.Background(), "caddy:rl:{192.0.2.50}:sw:10/2s").Result()
	if err != nil || n != 24+8*10 {
		t.Fatalf("log is %d bytes, want %d (header + 10 slots)", n, 24+8*10)
	}
}

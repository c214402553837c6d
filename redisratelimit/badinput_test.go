package redisratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	caddymap "github.com/caddyserver/caddy/v2/modules/caddyhttp/map"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Bad input from a client: a rate, window or cost that
// renders to something unusable is a 400 that counts nothing, whatever the
// fail policy; before, the fail policy answered it, so fail open a client
// turned its own limit off.

// badCosts render to no usable cost: a usable number is base-10 digits and
// nothing else, at least 1, within int64.
var badCosts = []string{
	"0", "-1", "1e3", "5abc", "+5", "5.0", "18446744073709551616", "", "0x10", "1_000", "five",
}

// badCostsDirect are bad too, but an HTTP server strips a header value's
// surrounding whitespace before any handler sees it, so they are sent
// without HTTP (a query placeholder, e.g., may carry them).
var badCostsDirect = []string{" 5", "5 ", "\t5"}

// costLimit provisions `rate 100 1m` with `cost {http.request.header.X-Cost}`
// from JSON, and serves it over HTTP; reached counts requests that got
// through to the next handler.
func costLimit(t *testing.T, r *testRedis, extra string) (*RedisRateLimit, string, *atomic.Int64) {
	t.Helper()
	h := provisionRateLimitJSON(t, fmt.Sprintf(`{
		"rates": [{"requests": 100, "window": "1m"}],
		"cost": "{http.request.header.X-Cost}",
		"redis": [%q]%s
	}`, r.Addr, extra))
	reached := new(atomic.Int64)
	srv := handlerServer(t, h, func(w http.ResponseWriter, r *http.Request) error {
		reached.Add(1)
		return okHandler(w, r)
	})
	return h, srv.URL, reached
}

// scriptCalls is how many scripts Redis ran.
func scriptCalls(r *testRedis) int64 { return r.CommandCalls("evalsha") + r.CommandCalls("eval") }

// wantBadRequest checks an answer to bad input: 400 with a reason that
// names what was bad, and no rate-limit fields (there was no decision).
func wantBadRequest(t *testing.T, what string, resp *http.Response, body, sub string) {
	t.Helper()
	if resp == nil {
		t.FailNow()
	}
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("%s: status %d (RateLimit %q), want 400", what, resp.StatusCode, resp.Header.Get(HeaderRateLimit))
	}
	if !strings.Contains(body, sub) {
		t.Errorf("%s: reason %q does not name the %s", what, body, sub)
	}
	for _, f := range []string{HeaderRateLimit, HeaderRateLimitPolicy, HeaderRetryAfter} {
		if v := resp.Header.Get(f); v != "" {
			t.Errorf("%s: bad input answered with %s %q", what, f, v)
		}
	}
}

// TestRateLimitBadCost: each X-Cost that is not a usable cost is a 400,
// with fail open and with fail_closed alike (never admitted, never 503),
// reaches nothing behind the limiter and writes nothing to Redis; a cost
// above the rate's n stays 429. With fail_closed and Redis down, bad input
// is still a 400: it never reaches the fail policy.
func TestRateLimitBadCost(t *testing.T) {
	t.Parallel()
	for _, closed := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_closed=%v", closed), func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			h, url, reached := costLimit(t, r, fmt.Sprintf(`, "fail_closed": %v`, closed))
			for _, v := range badCosts {
				resp, body := get(t, url, "X-Cost", v)
				wantBadRequest(t, fmt.Sprintf("X-Cost %q", v), resp, body, "cost")
			}
			resp, body := get(t, url) // no X-Cost at all
			wantBadRequest(t, "no X-Cost", resp, body, "cost")
			for _, v := range badCostsDirect {
				a := serveRL(h, "192.0.2.90", func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-Cost", v) })
				if a.passed || a.status != http.StatusBadRequest || a.header.Get(HeaderRateLimit) != "" {
					t.Fatalf("X-Cost %q: passed=%v status %d RateLimit %q, want 400", v, a.passed, a.status, a.header.Get(HeaderRateLimit))
				}
			}
			if n := reached.Load(); n != 0 {
				t.Fatalf("%d requests with a bad cost got through the limiter", n)
			}
			if n := r.Client().DBSize(context.Background()).Val(); n != 0 {
				t.Fatalf("bad costs left %d keys in Redis", n)
			}
			if n := scriptCalls(r); n != 0 {
				t.Fatalf("bad costs made %d script calls, want 0", n)
			}

			// A good cost counts; a cost above n is 429 at once, without
			// Retry-After and without calling Redis.
			if resp, _ := get(t, url, "X-Cost", "5"); resp == nil || resp.StatusCode != 200 || resp.Header.Get(HeaderRateLimit) != `"r0";r=95;t=60` {
				t.Fatalf("X-Cost 5: %v, want 200 with RateLimit r=95", resp)
			}
			calls := scriptCalls(r)
			for _, v := range []string{"101", "9223372036854775807"} {
				resp, _ := get(t, url, "X-Cost", v)
				if resp == nil || resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get(HeaderRetryAfter) != "" {
					t.Fatalf("X-Cost %s above n 100: %v, want 429 without Retry-After", v, resp)
				}
			}
			if n := scriptCalls(r) - calls; n != 0 {
				t.Fatalf("costs above n made %d script calls, want 0", n)
			}
			if n := reached.Load(); n != 1 {
				t.Fatalf("%d requests got through, want 1 (X-Cost 5)", n)
			}

			if !closed {
				return
			}
			r.Kill()
			for _, v := range []string{"1e3", ""} {
				resp, body := get(t, url, "X-Cost", v)
				wantBadRequest(t, fmt.Sprintf("Redis down: X-Cost %q", v), resp, body, "cost")
			}
			if resp, _ := get(t, url, "X-Cost", "1"); resp == nil || resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("Redis down, fail_closed, X-Cost 1: %v, want 503", resp)
			}
		})
	}
}

// TestRateLimitPlanMapWithoutDefault: `map {http.request.header.X-Plan}
// {plan_rpm} { pro 600; free 5 }` without `default` before `rate
// {plan_rpm} 1m`: a plan the map does not know, or no X-Plan at all, is a
// 400 (before, every such request was admitted unlimited), and the known
// plans are limited as ever.
func TestRateLimitPlanMapWithoutDefault(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, closed := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_closed=%v", closed), func(t *testing.T) {
			m := new(caddymap.Handler)
			if err := json.Unmarshal([]byte(`{
				"source": "{http.request.header.X-Plan}",
				"destinations": ["{plan_rpm}"],
				"mappings": [{"input": "pro", "outputs": ["600"]}, {"input": "free", "outputs": ["5"]}]
			}`), m); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			if err := m.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			h := provisionRateLimitJSON(t, fmt.Sprintf(`{
				"prefix": "closed=%v:",
				"rates": [{"requests": "{plan_rpm}", "window": "1m"}],
				"fail_closed": %v,
				"redis": [%q]
			}`, closed, closed, r.Addr))
			var reached atomic.Int64
			srv := handlerServer(t, m, func(w http.ResponseWriter, req *http.Request) error {
				return h.ServeHTTP(w, req, caddyhttp.HandlerFunc(func(w http.ResponseWriter, req *http.Request) error {
					reached.Add(1)
					return okHandler(w, req)
				}))
			})
			for _, hdr := range [][]string{{"X-Plan", "enterprise"}, {"X-Plan", ""}, nil} {
				for i := 0; i < 12; i++ {
					resp, body := get(t, srv.URL, hdr...)
					wantBadRequest(t, fmt.Sprintf("plan %q request %d", hdr, i+1), resp, body, "rate")
				}
			}
			if n := reached.Load(); n != 0 {
				t.Fatalf("%d requests of no plan got through", n)
			}
			for i := 0; i < 5; i++ {
				if resp, _ := get(t, srv.URL, "X-Plan", "free"); resp == nil || resp.StatusCode != 200 || resp.Header.Get(HeaderRateLimitPolicy) != `"r0";q=5;w=60` {
					t.Fatalf("free request %d: %v, want 200 with q=5", i+1, resp)
				}
			}
			if resp, _ := get(t, srv.URL, "X-Plan", "free"); resp == nil || resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("free request 6: %v, want 429", resp)
			}
			if resp, _ := get(t, srv.URL, "X-Plan", "pro"); resp == nil || resp.StatusCode != 200 || resp.Header.Get(HeaderRateLimit) != `"r0";r=599;t=60` {
				t.Fatalf("pro request: %v, want 200 with r=599", resp)
			}
			keys, _ := r.Client().Keys(context.Background(), fmt.Sprintf("closed=%v:*:sw:*", closed)).Result()
			if len(keys) != 2 {
				t.Fatalf("keys %v, want one per known plan", keys)
			}
		})
	}
}

// TestRateLimitBadRenderDryRun: under dry_run bad input is logged (once
// per template) but passes; it still writes nothing to Redis.
func TestRateLimitBadRenderDryRun(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	core, logs := observer.New(zapcore.WarnLevel)
	h, url, reached := costLimit(t, r, `, "dry_run": true, "fail_closed": true`)
	h.logger = zap.New(core)
	for _, v := range badCosts {
		if resp, _ := get(t, url, "X-Cost", v); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("dry run, X-Cost %q: %v, want passed", v, resp)
		}
	}
	if n := reached.Load(); n != int64(len(badCosts)) {
		t.Fatalf("dry run: %d of %d requests with a bad cost got through", n, len(badCosts))
	}
	if n := r.Client().DBSize(context.Background()).Val(); n != 0 {
		t.Fatalf("dry run: bad costs left %d keys in Redis", n)
	}
	if n := logs.FilterLevelExact(zapcore.ErrorLevel).Len(); n != 1 {
		t.Fatalf("%d error logs, want 1 (once per template): %v", n, logs.All())
	}
}

// TestRateLimitBadRequestMetric: bad input counts as
// caddy_redis_ratelimit_requests_total{result="bad_request"}, enforced or
// dry run, and never as an error (a Redis fault) or a decision.
func TestRateLimitBadRequestMetric(t *testing.T) {
	r := startRedis(t) // not parallel: reads the process-wide counters
	h := newRateLimit(t, r, func(h *RedisRateLimit) { h.Cost = "{http.request.header.X-Cost}" })
	dry := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Cost = "{http.request.header.X-Cost}"
		h.DryRun = true
	})
	shared.InitMetrics()
	results := []string{"allowed", "denied", "error", "bad_request"}
	before := make([]float64, len(results))
	for i := range results {
		before[i] = rlCounterValue(h.counters[i]) + rlCounterValue(dry.counters[i])
	}
	for _, v := range []string{"0", "1e3", ""} {
		for _, hh := range []*RedisRateLimit{h, dry} {
			serveRL(hh, "192.0.2.91", func(req *http.Request, _ *caddy.Replacer) { req.Header.Set("X-Cost", v) })
		}
	}
	for i, res := range results {
		want := 0.0
		if res == "bad_request" {
			want = 6
		}
		if d := rlCounterValue(h.counters[i]) + rlCounterValue(dry.counters[i]) - before[i]; d != want {
			t.Errorf("result=%q grew by %v, want %v", res, d, want)
		}
	}
}

// TestRateLimitRenderedGCRALimit: a rendered gcra n is bad input above one
// request per microsecond of its window, as a literal one is a config
// error. Before, the check saw n clipped to 2^31, so `rate {plan_rpm} 1h`
// took any n from 3600000001 up.
func TestRateLimitRenderedGCRALimit(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Algorithm = algoGCRA
		h.Rates = []Rate{rateOf(t, "{plan_rpm}", "1h")}
	})
	for _, tc := range []struct {
		rpm    string
		status int
	}{{"3600000001", 400}, {"5000000000", 400}, {"9223372036854775807", 400}, {"3600000000", 200}, {"100001", 200}} {
		a := serveRL(h, "192.0.2.92", withPlan(tc.rpm))
		if a.status != tc.status {
			t.Fatalf("gcra rate %s 1h: %d (%v), want %d", tc.rpm, a.status, a.err, tc.status)
		}
	}
}

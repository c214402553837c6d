package redisdlm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// TestWholeCaddyRateLimitPlans runs the whole Caddy with rates and costs
// from `map` (a plan per header, a cost per endpoint) and a login counted
// only when it fails: each plan gets its own limit and policy, an
// endpoint's cost counts against it, and successful logins cost nothing.
func TestWholeCaddyRateLimitPlans(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	port, admin := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	map {http.request.header.X-Plan} {plan_rpm} {
		pro 5
		default 2
	}
	map {path} {endpoint_cost} {
		~^/api/search 3
		default 1
	}
	route /api/* {
		redis_ratelimit {
			key {http.request.header.X-User}
			rate {plan_rpm} 1m
			cost {endpoint_cost}
			redis %s
		}
		respond "api"
	}
	route /login {
		redis_ratelimit {
			key {http.request.header.X-User}
			prefix login:
			rate 2 10m
			count 401
			redis %s
		}
		@bad header X-Password wrong
		respond @bad "no" 401
		respond "welcome"
	}
}
`, admin, port, r.Addr, r.Addr))
	call := caller(t, fmt.Sprintf("http://127.0.0.1:%d", port))
	for _, tc := range []struct {
		user, plan string
		n          int
	}{{"ann", "pro", 5}, {"bob", "free", 2}} {
		for i := 0; i < tc.n; i++ {
			resp := call("/api/items", "X-User", tc.user, "X-Plan", tc.plan)
			if resp.StatusCode != 200 {
				t.Fatalf("%s (%s) request %d: %d", tc.user, tc.plan, i+1, resp.StatusCode)
			}
			if got, want := resp.Header.Get("RateLimit-Policy"), fmt.Sprintf(`"r0";q=%d;w=60`, tc.n); got != want {
				t.Fatalf("%s: RateLimit-Policy %q, want %q", tc.user, got, want)
			}
		}
		if resp := call("/api/items", "X-User", tc.user, "X-Plan", tc.plan); resp.StatusCode != 429 {
			t.Fatalf("%s (%s): request %d got %d, want 429", tc.user, tc.plan, tc.n+1, resp.StatusCode)
		}
	}
	// Costs per endpoint: a search costs 3 of the pro plan's 5.
	if resp := call("/api/search", "X-User", "cid", "X-Plan", "pro"); resp.StatusCode != 200 || resp.Header.Get("RateLimit") != `"r0";r=2;t=60` {
		t.Fatalf("search: %d RateLimit %q, want 200 with r=2", resp.StatusCode, resp.Header.Get("RateLimit"))
	}
	if resp := call("/api/search", "X-User", "cid", "X-Plan", "pro"); resp.StatusCode != 429 {
		t.Fatalf("second search: %d, want 429 (3 more than the 2 left)", resp.StatusCode)
	}
	if resp := call("/api/items", "X-User", "cid", "X-Plan", "pro"); resp.StatusCode != 200 || resp.Header.Get("RateLimit") != `"r0";r=1;t=60` {
		t.Fatalf("cheaper item after a rejected search: %d RateLimit %q, want 200 with r=1", resp.StatusCode, resp.Header.Get("RateLimit"))
	}
	// Logins: successes are free, failures count.
	for i := 0; i < 5; i++ {
		if resp := call("/login", "X-User", "dee", "X-Password", "right"); resp.StatusCode != 200 {
			t.Fatalf("good login %d: %d", i+1, resp.StatusCode)
		}
	}
	for i, want := range []int{401, 401, 429, 429} {
		if resp := call("/login", "X-User", "dee", "X-Password", "wrong"); resp.StatusCode != want {
			t.Fatalf("bad login %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}
}

// TestWholeCaddyRateLimitPlanWithoutDefault runs the whole Caddy with a
// `map` without `default` before `rate {plan_rpm} 1m`, and a cost from a
// header under fail_closed: a plan the map does not know, no plan at all
// and an unusable cost are each a 400 (before, they were admitted
// unlimited, or 503 under fail_closed), counted as bad_request.
func TestWholeCaddyRateLimitPlanWithoutDefault(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	port, admin := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	map {http.request.header.X-Plan} {plan_rpm} {
		pro 600
		free 5
	}
	route /plan {
		redis_ratelimit {
			prefix plan:
			rate {plan_rpm} 1m
			redis %s
		}
		respond "plan"
	}
	route /cost {
		redis_ratelimit {
			prefix cost:
			rate 100 1m
			cost {http.request.header.X-Cost}
			fail_closed
			redis %s
		}
		respond "cost"
	}
}
`, admin, port, r.Addr, r.Addr))
	call := caller(t, fmt.Sprintf("http://127.0.0.1:%d", port))
	for _, hdr := range [][]string{{"X-Plan", "enterprise"}, nil} {
		for i := 0; i < 12; i++ {
			if resp := call("/plan", hdr...); resp.StatusCode != http.StatusBadRequest || resp.Header.Get("RateLimit") != "" {
				t.Fatalf("plan %q request %d: %d RateLimit %q, want 400", hdr, i+1, resp.StatusCode, resp.Header.Get("RateLimit"))
			}
		}
	}
	for i := 0; i < 5; i++ {
		if resp := call("/plan", "X-Plan", "free"); resp.StatusCode != 200 {
			t.Fatalf("free request %d: %d", i+1, resp.StatusCode)
		}
	}
	if resp := call("/plan", "X-Plan", "free"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("free request 6: %d, want 429", resp.StatusCode)
	}
	for _, v := range []string{"0", "-1", "1e3", "5abc", "+5", "5.0", "18446744073709551616", ""} {
		if resp := call("/cost", "X-Cost", v); resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("X-Cost %q: %d, want 400", v, resp.StatusCode)
		}
	}
	if resp := call("/cost", "X-Cost", "101"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("X-Cost 101 above n 100: %d, want 429", resp.StatusCode)
	}
	if resp := call("/cost", "X-Cost", "7"); resp.StatusCode != 200 || resp.Header.Get("RateLimit") != `"r0";r=93;t=60` {
		t.Fatalf("X-Cost 7: %d RateLimit %q, want 200 with r=93", resp.StatusCode, resp.Header.Get("RateLimit"))
	}
	if keys, _ := r.Client().Keys(context.Background(), "*").Result(); len(keys) != 3 || !strings.Contains(strings.Join(keys, " "), "}:rates") {
		t.Fatalf("keys %v, want the free plan's (and the key's rate index) and the cost limit's", keys)
	}
	mresp, err := http.Get(fmt.Sprintf("http://localhost:%d/metrics", admin))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	ms := regexp.MustCompile(`(?m)^caddy_redis_ratelimit_requests_total\{handler="[^"]*",result="bad_request"\} (\d+)`).FindAllSubmatch(b, -1)
	if ms == nil {
		t.Fatal(`metrics lack caddy_redis_ratelimit_requests_total{result="bad_request"}`)
	}
	n := 0 // over the handlers
	for _, m := range ms {
		v, _ := strconv.Atoi(string(m[1]))
		n += v
	}
	if n < 32 {
		t.Fatalf(`result="bad_request" is %d, want at least the 32 bad requests sent`, n)
	}
}

// caller returns a GET of base+path with headers that fails the test when
// no answer comes.
func caller(t *testing.T, base string) func(path string, hdr ...string) *http.Response {
	return func(path string, hdr ...string) *http.Response {
		t.Helper()
		resp, _ := get(t, base+path, hdr...)
		if resp == nil {
			t.FailNow()
		}
		return resp
	}
}

package redisdlm

import (
	"fmt"
	"net/http"
	"testing"
)

// TestWholeCaddyRateLimitPlans runs the whole Caddy with rates and costs
// from `map` (a plan per header, a cost per endpoint) and a login counted
// only when it fails: each plan gets its own limit and policy, an
// endpoint's cost counts against it, and successful logins cost nothing.
func TestWholeCaddyRateLimitPlans(t *testing.T) {
	skipWholeCaddyIfShort(t)
	r := startRedis(t)
	port, admin := freePort(t), freePort(t)
	runCaddy(t, fmt.Sprintf(`{
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
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	call := func(path string, hdr ...string) *http.Response {
		t.Helper()
		resp, _ := get(t, base+path, hdr...)
		if resp == nil {
			t.FailNow()
		}
		return resp
	}
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

package redisratelimit

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// chain serves a in front of b in front of next, as two handlers of one
// Caddy route.
type chain struct{ a, b caddyhttp.MiddlewareHandler }

func (c chain) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	return c.a.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		return c.b.ServeHTTP(w, r, next)
	}))
}

// TestStackedLimitersShowEveryPolicy: a
// gcra limiter (burst 1) then a sliding 3/5s limiter on one request: the
// RateLimit-Policy entries of both are sent, each under its handler's
// name, and RateLimit names the tightest — the burst, which rejects the
// next request — not whatever the later handler saw. Before, the later
// handler's fields replaced the earlier's: the client saw `"r0";r=2;t=5`
// and was rejected at once. A handler alone keeps its plain names.
func TestStackedLimitersShowEveryPolicy(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	burst := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"name":"burst","algorithm":"gcra","burst":1,"rates":[{"requests":1,"window":"10s"}],"prefix":"stack-b:"}`, r.Addr))
	window := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"name":"window","rates":[{"requests":3,"window":"5s"}],"prefix":"stack-w:"}`, r.Addr))
	srv := handlerServer(t, chain{burst, window}, okHandler)
	resp, _ := get(t, srv.URL)
	if resp == nil || resp.StatusCode != 200 {
		t.Fatalf("first request: %v", resp)
	}
	policy, rl := resp.Header.Get(HeaderRateLimitPolicy), resp.Header.Get(HeaderRateLimit)
	if policy != `"burst/r0";q=1;w=10, "window/r0";q=3;w=5` {
		t.Errorf("RateLimit-Policy %q, want both handlers' policies under their names", policy)
	}
	if !strings.HasPrefix(rl, `"burst/r0";r=0;`) {
		t.Errorf("RateLimit %q, want the tightest, the burst with 0 left", rl)
	}
	// The burst rejects the next request: the later handler never answers
	// it, so the burst's fields stand alone.
	resp, _ = get(t, srv.URL)
	if resp == nil || resp.StatusCode != 429 || resp.Header.Get(HeaderRateLimitPolicy) != `"r0";q=1;w=10` {
		t.Errorf("second request: %v, want 429 from the burst alone", resp)
	}

	// Unnamed handlers are named by a short hash of their config.
	a := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"rates":[{"requests":5,"window":"1m"}],"prefix":"stack-a:"}`, r.Addr))
	b := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"rates":[{"requests":50,"window":"1h"}],"prefix":"stack-c:"}`, r.Addr))
	so := handlerServer(t, chain{a, b}, okHandler)
	resp, _ = get(t, so.URL)
	want := fmt.Sprintf(`"%s/r0";q=5;w=60, "%s/r0";q=50;w=3600`, a.label, b.label)
	if got := resp.Header.Get(HeaderRateLimitPolicy); got != want || !strings.HasPrefix(a.label, "rl-") || a.label == b.label {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got := resp.Header.Get(HeaderRateLimit); !strings.HasPrefix(got, `"`+a.label+`/r0";r=4;`) {
		t.Errorf("RateLimit %q, want the 5/1m one (4 left)", got)
	}

	// Alone, a handler keeps its plain names.
	sa := handlerServer(t, window, okHandler)
	resp, _ = get(t, sa.URL+"/alone")
	if got := resp.Header.Get(HeaderRateLimitPolicy); got != `"r0";q=3;w=5` {
		t.Errorf("a handler alone: RateLimit-Policy %q", got)
	}
}

// TestStackedLimiterFailOpen: a stacked limiter that answers by its fail
// policy (its Redis is down: fail open) hides nothing of the other's
// state, whichever comes first: both policies are sent under
// their handlers' names, and RateLimit is the deciding one's, under its
// name.
func TestStackedLimiterFailOpen(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	ok := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"name":"up","rates":[{"requests":5,"window":"1m"}],"prefix":"stack-up:"}`, r.Addr))
	down := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["127.0.0.1:%d"],"name":"down","timeout":"100ms","rates":[{"requests":50,"window":"1h"}]}`, freePort(t)))
	for _, tc := range []struct {
		name string
		c    chain
	}{{"deciding one first", chain{ok, down}}, {"failing one first", chain{down, ok}}} {
		srv := handlerServer(t, tc.c, okHandler)
		resp, _ := get(t, srv.URL+"/"+strings.ReplaceAll(tc.name, " ", "-"))
		if resp == nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %v, want 200 (fail open)", tc.name, resp)
		}
		policy, rl := resp.Header.Get(HeaderRateLimitPolicy), resp.Header.Get(HeaderRateLimit)
		if !strings.Contains(policy, `"up/r0";q=5;w=60`) || !strings.Contains(policy, `"down/r0";q=50;w=3600`) {
			t.Errorf("%s: RateLimit-Policy %q, want both, under their names", tc.name, policy)
		}
		if !strings.HasPrefix(rl, `"up/r0";r=`) {
			t.Errorf("%s: RateLimit %q, want the deciding handler's, named up/r0", tc.name, rl)
		}
	}
}

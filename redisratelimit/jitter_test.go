package redisratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestJitter: `jitter` raises the rate limiter's Retry-After by a random
// share up to the fraction: never below what it is without jitter, never
// above (1 + fraction) of it, and not the same for every client; RateLimit's
// t= is not jittered. (The lock's: redislock's TestJitter.)
func TestJitter(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	t.Run("redis_ratelimit", func(t *testing.T) {
		t.Parallel()
		h := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"rates":[{"requests":1,"window":"100s"}],"jitter":0.5}`, r.Addr))
		srv := handlerServer(t, h, okHandler)
		if resp, _ := get(t, srv.URL); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("first request: %v", resp)
		}
		testkit.CheckSpread(t, testkit.RetryAfters(t, srv.URL, 30, http.StatusTooManyRequests), 99, 151)
		resp, _ := get(t, srv.URL)
		if rl := resp.Header.Get(HeaderRateLimit); rl == "" || rl != fmt.Sprintf(`"r0";r=0;t=%s`, rlT(rl)) || rlT(rl) == "" {
			t.Fatalf("RateLimit %q", rl)
		} else if tv, _ := strconv.Atoi(rlT(rl)); tv > 100 {
			t.Fatalf("RateLimit t=%d: jittered (the window is 100s)", tv)
		}
	})
	t.Run("config", func(t *testing.T) {
		t.Parallel()
		for _, block := range []string{"redis_ratelimit {\n\trate 1 1s\n\tjitter -0.1\n}"} {
			err := new(RedisRateLimit).UnmarshalCaddyfile(caddyfile.NewTestDispenser(block))
			if err == nil || !strings.Contains(err.Error(), "jitter") {
				t.Errorf("%q: %v, want a jitter error", block, err)
			}
		}
	})
}

// rlT is the t= of a RateLimit field.
func rlT(rl string) string {
	_, t, _ := strings.Cut(rl, "t=")
	return t
}

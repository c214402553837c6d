package redislock

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// retryAfters collects the Retry-After of n rejected requests.
func retryAfters(t *testing.T, url string, n int, wantStatus int) []int {
	t.Helper()
	var got []int
	for range n {
		resp, _ := get(t, url)
		if resp == nil || resp.StatusCode != wantStatus {
			t.Fatalf("%v, want %d", resp, wantStatus)
		}
		v, err := strconv.Atoi(resp.Header.Get("Retry-After"))
		if err != nil {
			t.Fatalf("Retry-After %q: %v", resp.Header.Get("Retry-After"), err)
		}
		got = append(got, v)
	}
	return got
}

// TestJitter: `jitter` raises the lock's Retry-After by a random share up
// to the fraction: never below what it is without jitter, never above
// (1 + fraction) of it, and not the same for every client. (The rate
// limiter's: the root's TestJitter.)
func TestJitter(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	spread := func(t *testing.T, got []int, lo, hi int) {
		t.Helper()
		seen := map[int]bool{}
		for _, v := range got {
			if v < lo || v > hi {
				t.Fatalf("Retry-After %v, want each in [%d, %d]", got, lo, hi)
			}
			seen[v] = true
		}
		if len(seen) < 3 {
			t.Fatalf("Retry-After %v: %d distinct values, want them spread", got, len(seen))
		}
	}
	t.Run("redis_lock", func(t *testing.T) {
		t.Parallel()
		up := testkit.NewHoldUpstream()
		h := provisionLock(t, testkit.LockConfig(r.Addr, `"ttl":"40s","wait":"0s","jitter":1,"prefix":"jit:"`))
		srv := handlerServer(t, h, up.ServeHTTP)
		testkit.StartHolder(t, up, srv.URL+"/hot")
		// No hold seen yet: the estimate is the lease left (about 40 s).
		spread(t, retryAfters(t, srv.URL+"/hot", 30, http.StatusLocked), 38, 81)
	})
	t.Run("config", func(t *testing.T) {
		t.Parallel()
		for _, block := range []string{"redis_lock {\n\tjitter 1.5\n}", "redis_lock {\n\tjitter x\n}"} {
			err := new(RedisLock).UnmarshalCaddyfile(caddyfile.NewTestDispenser(block))
			if err == nil || !strings.Contains(err.Error(), "jitter") {
				t.Errorf("%q: %v, want a jitter error", block, err)
			}
		}
	})
}

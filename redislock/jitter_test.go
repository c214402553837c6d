package redislock

import (
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestJitter: `jitter` raises the lock's Retry-After by a random share up
// to the fraction: never below what it is without jitter, never above
// (1 + fraction) of it, and not the same for every client. (The rate
// limiter's: redisratelimit's TestJitter.)
func TestJitter(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	t.Run("redis_lock", func(t *testing.T) {
		t.Parallel()
		up := testkit.NewHoldUpstream()
		h := provisionLock(t, testkit.LockConfig(r.Addr, `"ttl":"40s","wait":"0s","jitter":1,"prefix":"jit:"`))
		srv := handlerServer(t, h, up.ServeHTTP)
		testkit.StartHolder(t, up, srv.URL+"/hot")
		// No hold seen yet: the estimate is the lease left (about 40 s).
		testkit.CheckSpread(t, testkit.RetryAfters(t, srv.URL+"/hot", 30, http.StatusLocked), 38, 81)
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

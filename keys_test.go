package redisdlm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestKeyFormsSameInBothHandlers: both handlers accept and reject the same
// placeholder forms in JSON (which skips the Caddyfile's shorthand
// expansion), and an accepted shorthand renders at request time.
func TestKeyFormsSameInBothHandlers(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, tc := range []struct {
		key string
		ok  bool
	}{
		{"{vars.user}", true},
		{"{header.X-User}", true},
		{"{http.request.header.X-User}", true},
		{"{query.u}", true},
		{"{client_ip}", true},
		{"u:{foo.bar}", false},
		{"{nope}", false},
		{"{http.request.header.X", false},
	} {
		t.Run(tc.key, func(t *testing.T) {
			lock := new(redislock.RedisLock)
			cfg := fmt.Sprintf(`{"redis":[%q],"keys":[%q]}`, r.Addr, tc.key)
			if err := json.Unmarshal([]byte(cfg), lock); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			lerr := lock.Provision(ctx)
			defer lock.Cleanup()
			rl := &redisratelimit.RedisRateLimit{Key: tc.key, Rates: []redisratelimit.Rate{{Requests: 5, Window: caddy.Duration(60e9)}}}
			rl.Addresses = []string{r.Addr}
			rerr := rl.Provision(ctx)
			defer rl.Cleanup()
			if (lerr == nil) != tc.ok || (rerr == nil) != tc.ok {
				t.Fatalf("lock: %v; rate limit: %v; want accepted=%v by both", lerr, rerr, tc.ok)
			}
			if !tc.ok {
				return
			}
			req, _ := http.NewRequest("GET", "http://example.com/?u=alice", nil)
			req.Header.Set("X-User", "alice")
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, map[string]any{"user": "alice", caddyhttp.ClientIPVarKey: "alice"}))
			repl := caddyhttp.NewTestReplacer(req)
			// The lock renders its keys as it serves: the key it held is
			// in its placeholder, and in Redis while the route runs.
			var rendered string
			var held int64
			err := lock.ServeHTTP(httptest.NewRecorder(), req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl)),
				caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
					rendered = repl.ReplaceAll("{http.redis_lock.key}", "")
					held, _ = r.Client().Exists(context.Background(), shared.StoredKey(lock.Prefix, "alice")).Result()
					return nil
				}))
			if err != nil || rendered != "alice" || held != 1 {
				t.Errorf("lock rendered %q (held in Redis: %d), %v; want the key of alice", rendered, held, err)
			}
			// The limiter renders its key as it decides: its state is under
			// the key of alice.
			if err := rl.ServeHTTP(httptest.NewRecorder(), req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl)), caddyhttp.HandlerFunc(okHandler)); err != nil {
				t.Errorf("rate limit: %v", err)
			}
			if n, _ := r.Client().Exists(context.Background(), redisratelimit.DefaultRateLimitPrefix+"{alice}:sw:5/1m0s").Result(); n != 1 {
				t.Errorf("rate limit rendered another key than alice: %v", r.Client().Keys(context.Background(), redisratelimit.DefaultRateLimitPrefix+"*").Val())
			}
		})
	}
}

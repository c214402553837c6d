package redisdlm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestKeyWithEmptyPlaceholder: a key in which one placeholder renders empty
// or unknown never becomes a shared key ("user:" for everyone without the
// header): the lock answers 400, the rate limiter limits by client IP.
func TestKeyWithEmptyPlaceholder(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	lock := provisionLock(t, lockCfg(r.Addr, `"keys":["inventory:{http.request.uri.query.sku1}"],"wait":"0s"`))
	srv := handlerServer(t, lock, okHandler)
	if resp, _ := get(t, srv.URL+"/order?sku2=b"); resp == nil || resp.StatusCode != 400 {
		t.Errorf("lock key with an empty placeholder: status %v, want 400", resp)
	}
	if resp, _ := get(t, srv.URL+"/order?sku1=a"); resp == nil || resp.StatusCode != 200 {
		t.Errorf("lock key rendered whole: status %v, want 200", resp)
	}

	rl := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Key = "user:{http.request.header.X-User}"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(60e9)}}
	})
	if a := serveRL(rl, "192.0.2.1", nil); !a.passed {
		t.Fatal("first client without the header rejected")
	}
	if a := serveRL(rl, "192.0.2.2", nil); !a.passed {
		t.Fatal("a second client without the header shared the first one's bucket")
	}
	if a := serveRL(rl, "192.0.2.1", nil); a.passed {
		t.Fatal("the first client's own (client-IP) bucket did not limit it")
	}
}

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
			lock := new(RedisLock)
			cfg := fmt.Sprintf(`{"redis":[%q],"keys":[%q]}`, r.Addr, tc.key)
			if err := json.Unmarshal([]byte(cfg), lock); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			lerr := lock.Provision(ctx)
			defer lock.Cleanup()
			rl := &RedisRateLimit{Key: tc.key, Rates: []Rate{{Requests: 5, Window: caddy.Duration(60e9)}}}
			rl.Addresses = []string{r.Addr}
			rerr := rl.Provision(ctx)
			defer rl.Cleanup()
			if (lerr == nil) != tc.ok || (rerr == nil) != tc.ok {
				t.Fatalf("lock: %v; rate limit: %v; want accepted=%v by both", lerr, rerr, tc.ok)
			}
			if !tc.ok {
				return
			}
			quietLock(lock)
			quietRateLimit(rl)
			req, _ := http.NewRequest("GET", "http://example.com/?u=alice", nil)
			req.Header.Set("X-User", "alice")
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, map[string]any{"user": "alice", caddyhttp.ClientIPVarKey: "alice"}))
			repl := caddyhttp.NewTestReplacer(req)
			keys, _, err := lock.renderKeys(repl)
			if err != nil || len(keys) != 1 || !strings.Contains(keys[0], "{alice}") {
				t.Errorf("lock rendered %v, %v; want the key of alice", keys, err)
			}
			if id := rl.limitID(req, repl); id != "alice" {
				t.Errorf("rate limit rendered %q, want alice", id)
			}
		})
	}
}

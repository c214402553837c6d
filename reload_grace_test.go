package redisdlm

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestReloadGraceForRequestsOnTheirWay: a reload's old servers finish their
// requests after Cleanup, and such a request may reach the lock or the
// limiter only then (after a slow forward_auth, say). For destructGrace
// (10 s in Caddy) the old client still serves it, and an admission's
// settle after Cleanup is still sent. After that the client is closed and
// no new batcher is started on it. Before, the client closed at Cleanup:
// such requests got "redis: client is closed" (503), and a settle was lost.
func TestReloadGraceForRequestsOnTheirWay(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h, cleanup := provisionLockScoped(t, testkit.LockConfig(r.Addr, `"timeout":"456ms"`))
	// The lock's client: the same settings.
	rl, rlCleanup := provisionRateLimitScoped(t, fmt.Sprintf(`{"redis":["%s"],"timeout":"456ms","rates":[{"requests":1,"window":"1m"}],"count":["401"]}`, r.Addr))
	rlc := rateLimitClient(t, rl)
	if rlc.Redis != lockClient(t, h) {
		t.Fatal("the lock and the limiter with the same settings do not share a client")
	}
	cleanup()                            // the old config goes away ...
	rlCleanup()                          // ... with both handlers
	time.Sleep(shared.DestructGrace / 2) // while its requests are on their way
	if resp, body := get(t, handlerServer(t, h, okHandler).URL+"/late"); resp == nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("a lock request of the old config after Cleanup: %v %s", resp, body)
	}
	answer := func(status int) caddyhttp.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) error { w.WriteHeader(status); return nil }
	}
	if resp, body := get(t, handlerServer(t, rl, answer(200)).URL); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("a limited request of the old config after Cleanup: %v %s", resp, body)
	}
	// Its answer did not count: the settle gave the unit back.
	if resp, body := get(t, handlerServer(t, rl, answer(401)).URL); resp == nil || resp.StatusCode != 401 {
		t.Fatalf("after a settle sent after Cleanup: %v %s, want the unit given back (the upstream's 401)", resp, body)
	}
	client := rlc.Redis
	if !waitFor(shared.DestructGrace+5*time.Second, func() bool { return client.Ping(context.Background()).Err() != nil }) {
		t.Fatal("the old client was not closed after the grace")
	}
	if err := rlc.RateLimit(context.Background(), new(ratelimit.Call), nil); !errors.Is(err, ratelimit.ErrBatcherDone) {
		t.Fatalf("a call on a closed client: %v, want ratelimit.ErrBatcherDone", err)
	}
	if b := rlc.Batcher(); b == nil {
		t.Fatal("no batcher: the limiter's calls did not run")
	} else {
		select {
		case <-b.Stopped():
		default:
			t.Fatal("the batcher of a closed client still runs")
		}
	}
}

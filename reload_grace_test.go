package redisdlm

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
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
	h, cleanup := provisionLockScoped(t, lockCfg(r.Addr, `"timeout":"456ms"`))
	rl, rlCleanup := newRateLimitScoped(t, r, func(rl *RedisRateLimit) {
		rl.Rates, rl.Count = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}, []string{"401"}
		rl.Timeout = caddy.Duration(456 * time.Millisecond) // the lock's client
	})
	if rl.client.Redis != lockClient(t, h) {
		t.Fatal("the lock and the limiter with the same settings do not share a client")
	}
	cleanup()                            // the old config goes away ...
	rlCleanup()                          // ... with both handlers
	time.Sleep(shared.DestructGrace / 2) // while its requests are on their way
	if resp, body := get(t, handlerServer(t, h, okHandler).URL+"/late"); resp == nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("a lock request of the old config after Cleanup: %v %s", resp, body)
	}
	ok := func(status int) caddyhttp.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) error { w.WriteHeader(status); return nil }
	}
	if a := serveRLWith(context.Background(), rl, "192.0.2.90", nil, ok(200)); !a.passed {
		t.Fatalf("a limited request of the old config after Cleanup: %d %v", a.status, a.err)
	}
	// Its answer did not count: the settle gave the unit back.
	if a := serveRLWith(context.Background(), rl, "192.0.2.90", nil, ok(401)); !a.passed {
		t.Fatalf("after a settle sent after Cleanup: %d %v, want the unit given back", a.status, a.err)
	}
	client := rl.client.Redis
	if !waitFor(shared.DestructGrace+5*time.Second, func() bool { return client.Ping(context.Background()).Err() != nil }) {
		t.Fatal("the old client was not closed after the grace")
	}
	if _, err := rl.client.RateLimit(context.Background(), &ratelimit.Call{Script: ratelimit.SlidingScript}, (*breakerLog)(rl)); !errors.Is(err, ratelimit.ErrBatcherDone) {
		t.Fatalf("a call on a closed client: %v, want ratelimit.ErrBatcherDone", err)
	}
	if b := rl.client.Batcher(); b == nil {
		t.Fatal("no batcher: the limiter's calls did not run")
	} else {
		select {
		case <-b.Stopped():
		default:
			t.Fatal("the batcher of a closed client still runs")
		}
	}
}

// TestSettleAfterTheGrace: a limited request of the old config admitted
// during the grace and answered after it still gives its reservation back
// (count): its handler keeps the client open until it ends. Before, the
// client closed at the end of the grace and the settle was lost.
func TestSettleAfterTheGrace(t *testing.T) {
	// Not parallel: it times a settle against the reload grace, which a machine busy with 15 other tests cannot promise.
	r := startRedis(t)
	mk := func(timeout time.Duration) (*RedisRateLimit, func()) {
		return newRateLimitScoped(t, r, func(rl *RedisRateLimit) {
			rl.Rates, rl.Count = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}, []string{"401"}
			rl.Timeout = caddy.Duration(timeout) // a client of its own
		})
	}
	old, reload := mk(567 * time.Millisecond)
	reload() // the request below is on its way
	slow := func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(shared.DestructGrace + 300*time.Millisecond) // answers after the grace
		w.WriteHeader(http.StatusOK)                            // not counted: the unit goes back
		return nil
	}
	if a := serveRLWith(context.Background(), old, "192.0.2.91", nil, slow); !a.passed {
		t.Fatalf("the old config's request: %d %v", a.status, a.err)
	}
	fresh, _ := mk(678 * time.Millisecond)
	if a := serveRLWith(context.Background(), fresh, "192.0.2.91", nil, nil); !a.passed {
		t.Fatalf("the unit of an answer that did not count was not given back: %d %q", a.status, a.header.Get(HeaderRateLimit))
	}
}

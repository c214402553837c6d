package redisratelimit

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
)

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

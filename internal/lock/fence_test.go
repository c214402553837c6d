package lock

import (
	"context"
	"testing"
	"time"
)

// TestFencingTokensSurviveRestartAndExpiry: tokens strictly increase across
// a Redis restarted empty and across the expiry of the fencing counter,
// which expires once its lock is idle.
func TestFencingTokensSurviveRestartAndExpiry(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	r := rs[0]
	// ttl 1s: the counter lives a ttl past the newest lease, long enough
	// for the PTTL check below on a loaded machine.
	o := testOptions()
	o.TTL = time.Second
	l, _ := testLocker(t, rs, o)
	ctx := context.Background()
	key := "caddy:lock:{/fence}"
	var last int64
	take := func(what string) {
		t.Helper()
		ls, err := l.Acquire(ctx, []string{key})
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ls.Fence() <= last {
			t.Fatalf("%s: token %d after %d", what, ls.Fence(), last)
		}
		last = ls.Fence()
		ls.Release()
	}
	for i := 0; i < 3; i++ {
		take("before the restart")
	}
	if pttl, _ := r.Client().PTTL(ctx, FenceKey(key)).Result(); pttl <= 0 {
		t.Fatalf("fencing counter has no expiry (PTTL %s)", pttl)
	}
	r.Restart()
	take("after a restart empty")
	if !waitFor(10*time.Second, func() bool { return r.Client().Exists(ctx, FenceKey(key)).Val() == 0 }) {
		t.Fatal("fencing counter of an idle lock did not expire")
	}
	take("after the counter expired")
}

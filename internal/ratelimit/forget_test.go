package ratelimit

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// recordForgetter records what a ForgetListener tells it.
type recordForgetter struct {
	mu   sync.Mutex
	ids  []string
	alls int
}

func (f *recordForgetter) Forget(prefix, id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ids = append(f.ids, prefix+"|"+id)
}

func (f *recordForgetter) ForgetAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.alls++
}

func (f *recordForgetter) state() ([]string, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.ids...), f.alls
}

// waitFor polls cond every 20ms for at most d.
func waitFor(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// TestForgetListener: a reset published on one client reaches the listener
// of another (the other instance) as its prefix and id; after Redis comes
// back from a restart, the listener subscribes again and forgets
// everything, since a reset may have been published meanwhile. Close stops
// it.
func TestForgetListener(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	f := &recordForgetter{}
	l := ListenForget(r.Client(), f, slog.Default)
	defer l.Close()
	pub := r.Client()
	ctx := context.Background()
	// Published until the listener is subscribed (a message before that is
	// not delivered).
	if !waitFor(10*time.Second, func() bool {
		_ = PublishForget(ctx, pub, "caddy:rl:", "mallory")
		ids, _ := f.state()
		return len(ids) > 0
	}) {
		t.Fatal("a published reset never reached the listener")
	}
	if ids, alls := f.state(); ids[0] != "caddy:rl:|mallory" || alls != 0 {
		t.Fatalf("listener told %v and %d forget-alls, want caddy:rl:|mallory and none (the first subscription forgets nothing)", ids, alls)
	}
	r.Restart()
	if !waitFor(20*time.Second, func() bool { _, alls := f.state(); return alls > 0 }) {
		t.Fatal("after a Redis restart the listener did not forget everything on subscribing again")
	}
}

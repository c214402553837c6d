package ratelimit

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// recordForgetter records what a ForgetListener tells it.
type recordForgetter struct {
	mu   sync.Mutex
	ids  []string
	bans []string
	alls int
}

func (f *recordForgetter) Forget(prefix, id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ids = append(f.ids, prefix+"|"+id)
}

func (f *recordForgetter) Ban(prefix, id string, left, retry time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.bans = append(f.bans, fmt.Sprintf("%s|%s|%s|%s", prefix, id, left, retry))
}

func (f *recordForgetter) ForgetAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.alls++
}

func (f *recordForgetter) state() (ids, bans []string, alls int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ids), slices.Clone(f.bans), f.alls
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

// TestForgetListener: a reset and a ban published on one client reach the
// listener of another (the other instance): the reset as its prefix and
// id, the ban with how long it lasts. After Redis comes back from a
// restart, the listener subscribes again and forgets everything, since a
// reset may have been published meanwhile. Close stops it.
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
		ids, _, _ := f.state()
		return len(ids) > 0
	}) {
		t.Fatal("a published reset never reached the listener")
	}
	if err := PublishBan(ctx, pub, "caddy:rl:", "carol\x00x", 29*time.Second, 31*time.Second); err != nil {
		t.Fatal(err)
	}
	want := "caddy:rl:|carol\x00x|29s|31s"
	if !waitFor(10*time.Second, func() bool { _, bans, _ := f.state(); return len(bans) > 0 }) {
		t.Fatal("a published ban never reached the listener")
	}
	if ids, bans, alls := f.state(); ids[0] != "caddy:rl:|mallory" || bans[0] != want || alls != 0 || slices.Contains(ids, "{ban}|"+want) {
		t.Fatalf("listener told resets %q, bans %q and %d forget-alls, want caddy:rl:|mallory, %q and none (the first subscription forgets nothing)", ids, bans, alls, want)
	}
	r.Restart()
	if !waitFor(20*time.Second, func() bool { _, _, alls := f.state(); return alls > 0 }) {
		t.Fatal("after a Redis restart the listener did not forget everything on subscribing again")
	}
}

// TestParseBanBadInput: a message that is not a well-formed ban is no ban,
// and never a panic; one that is parses whole, its id last (it may hold
// anything).
func TestParseBanBadInput(t *testing.T) {
	t.Parallel()
	for _, m := range []string{"", "{ban}", "{ban}\x00", "{ban}\x00p\x001000", "{ban}\x00p\x00x\x001\x00id",
		"{ban}\x00p\x000\x000\x00id", "{ban}\x00p\x00-5\x001\x00id", "{ban}\x00p\x001\x00-1\x00id",
		"{ban}\x00p\x0099999999999999999999\x001\x00id", "caddy:rl:\x00{ban}"} {
		if _, _, _, _, ok := parseBan(m); ok {
			t.Errorf("parseBan(%q): a ban, want none", m)
		}
	}
	prefix, id, left, retry, ok := parseBan("{ban}\x00caddy:rl:\x001500\x002000\x00a\x00b")
	if !ok || prefix != "caddy:rl:" || id != "a\x00b" || left != 1500*time.Millisecond || retry != 2*time.Second {
		t.Fatalf("parseBan: %q %q %s %s %v", prefix, id, left, retry, ok)
	}
}

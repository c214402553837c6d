package ratelimit

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// recordForgetter records what a ForgetListener tells it.
type recordForgetter struct {
	mu     sync.Mutex
	ids    []string
	bans   []string
	resubs []bool // each resubscription: whether Redis runs a new process
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

func (f *recordForgetter) Resubscribed(newProcess bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.resubs = append(f.resubs, newProcess)
}

func (f *recordForgetter) state() (ids, bans []string, resubs []bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ids), slices.Clone(f.bans), slices.Clone(f.resubs)
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

// checkedClient is a client whose connections read the server's process
// (redisconn.Check), as the plugin's are.
func checkedClient(t *testing.T, addr string) (*redisconn.Check, Subscriber) {
	t.Helper()
	check := redisconn.NewCheck(redisconn.CheckOptions{Logger: func() *slog.Logger { return slog.New(slog.DiscardHandler) }})
	s := redisconn.Settings{Mode: "single", Addrs: []string{addr}, Timeout: 2 * time.Second}
	c, err := s.NewClient(check)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return check, c
}

// TestForgetListener: a reset and a ban published on one client reach the
// listener of another (the other instance): the reset as its prefix and
// id, the ban with how long it lasts. When its Pub/Sub connection is cut,
// the listener subscribes again and says Redis runs the same process; after
// Redis restarted, that it runs a new one, though the listener's client
// made no call but the subscription (go-redis reads the process on the
// Pub/Sub connection before it subscribes). Close stops it.
func TestForgetListener(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	f := &recordForgetter{}
	check, sub := checkedClient(t, r.Addr)
	l := ListenForget(sub, f, check.Restarts, slog.Default)
	defer l.Close()
	pub := r.Client()
	ctx := context.Background()
	// Published until the listener is subscribed (a message before that is
	// not delivered).
	if !waitFor(10*time.Second, func() bool {
		_ = publishForget(ctx, pub, "caddy:rl:", "mallory")
		ids, _, _ := f.state()
		return len(ids) > 0
	}) {
		t.Fatal("a published reset never reached the listener")
	}
	if err := publishBan(ctx, pub, "caddy:rl:", "carol\x00x", 29*time.Second, 31*time.Second); err != nil {
		t.Fatal(err)
	}
	want := "caddy:rl:|carol\x00x|29s|31s"
	if !waitFor(10*time.Second, func() bool { _, bans, _ := f.state(); return len(bans) > 0 }) {
		t.Fatal("a published ban never reached the listener")
	}
	if ids, bans, resubs := f.state(); ids[0] != "caddy:rl:|mallory" || bans[0] != want || len(resubs) != 0 || slices.Contains(ids, "{ban}|"+want) {
		t.Fatalf("listener told resets %q, bans %q and %d resubscriptions, want caddy:rl:|mallory, %q and none (the first subscription is no resubscription)", ids, bans, len(resubs), want)
	}

	if err := pub.Do(ctx, "client", "kill", "type", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	if !waitFor(20*time.Second, func() bool { _, _, resubs := f.state(); return len(resubs) > 0 }) {
		t.Fatal("the listener did not subscribe again after its connection was cut")
	}
	if _, _, resubs := f.state(); resubs[0] {
		t.Fatalf("resubscribed after CLIENT KILL: told a new process, want the same (resubscriptions %v)", resubs)
	}
	r.Restart()
	if !waitFor(20*time.Second, func() bool { _, _, resubs := f.state(); return len(resubs) > 1 }) {
		t.Fatal("after a Redis restart the listener did not subscribe again")
	}
	if _, _, resubs := f.state(); !resubs[1] {
		t.Fatalf("resubscribed after a restart: told the same process, want a new one (resubscriptions %v)", resubs)
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

// TestWriteBackBans: a ban written back to a Redis that lacks it expires
// when the ban ends and holds the moment a request may pass (Redis TIME +
// retry), as the decision script would have set it; a ban key that is
// there is left as it is.
func TestWriteBackBans(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := r.Client()
	ctx := context.Background()
	if err := c.Set(ctx, "p{there}:ban", "7", 50*time.Second).Err(); err != nil {
		t.Fatal(err)
	}
	n, err := WriteBackBans(ctx, c, []KeptBan{
		{Key: "p{gone}:ban", Left: 20 * time.Second, Retry: 25 * time.Second},
		{Key: "p{there}:ban", Left: 10 * time.Second, Retry: 10 * time.Second},
	})
	if err != nil || n != 1 {
		t.Fatalf("WriteBackBans: %d %v, want 1 written", n, err)
	}
	now, _ := c.Time(ctx).Result()
	if ttl := c.PTTL(ctx, "p{gone}:ban").Val(); ttl < 18*time.Second || ttl > 20*time.Second {
		t.Fatalf("the ban written back expires in %s, want about 20s", ttl)
	}
	v, _ := strconv.ParseInt(c.Get(ctx, "p{gone}:ban").Val(), 10, 64)
	if at := time.UnixMicro(v).Sub(now); at < 23*time.Second || at > 25*time.Second {
		t.Fatalf("the ban written back lets a request pass in %s, want about 25s", at)
	}
	if v := c.Get(ctx, "p{there}:ban").Val(); v != "7" || c.PTTL(ctx, "p{there}:ban").Val() < 40*time.Second {
		t.Fatalf("a ban key that was there: %q, want it left as it was", v)
	}
}

package lock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestPausedHolderIsNotRevived: a holder whose process was paused past its
// lease (modelled by a lease nobody extends) must find it lost when it
// extends again — on one server and on a Redlock quorum, where the extend
// script used to re-create the missing lease — even after a rival held
// and released the lock meanwhile. Its clock stands still meanwhile (a
// paused process does not see time pass), so it is Redis that refuses;
// once its clock catches up, the extension is refused before Redis is
// asked.
func TestPausedHolderIsNotRevived(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, rs []*testredis.Server) {
		clock := newFakeClock()
		o := testOptions()
		o.TTL, o.Wait, o.Clock = 600*time.Millisecond, 5*time.Second, clock
		l, _ := testLocker(t, rs, o)
		o.Clock = nil
		rival, _ := testInstance(t, "rival", rs, o)
		ctx := context.Background()
		keys := []string{"caddy:lock:{/paused}"}
		ls, err := l.Acquire(ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		if !allFree(10*time.Second, keys[0], rs) { // "paused" past the lease
			t.Fatal("the lease never ran out in Redis")
		}
		other, err := rival.Acquire(ctx, keys)
		if err != nil {
			t.Fatalf("rival: %v", err)
		}
		other.Release()
		if err := l.Extend(ctx, ls); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("extension after the lease ran out: %v, want ErrLeaseLost", err)
		}
		for _, r := range rs {
			// The rival's release may still be on its way to a minority;
			// what must not be there is the lapsed lease's own token.
			if _, err := r.Client().ZScore(ctx, keys[0], ls.token).Result(); err != redis.Nil {
				t.Errorf("%s holds the lapsed lease again (%v)", r, err)
			}
		}
		// The keeper reports it through on_lost.
		lost := make(chan error, 1)
		k := ls.Keep(KeepOptions{Extend: true, OnLost: func(err error) { lost <- err }})
		defer k.Stop()
		select {
		case err := <-lost:
			if !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("on_lost got %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the keeper did not report the lapsed lease lost")
		}
		clock.Advance(o.TTL)
		if err := l.Extend(ctx, ls); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("extension after the lease ran out by the holder's own clock: %v, want ErrLeaseLost", err)
		}
	})
}

// TestRedlockRestartedMemberRecreatedAtOnce: the extension round after a
// member restarted empty re-creates the lease there, although a majority
// answered first (its call is not cut off).
func TestRedlockRestartedMemberRecreatedAtOnce(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	o := testOptions()
	o.TTL = 20 * time.Second
	l, _ := testLocker(t, rs, o)
	key := "caddy:lock:{/member}"
	ls, err := l.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatal(err)
	}
	defer ls.Release()
	rs[0].Restart()
	ctx, cancel := context.WithCancel(context.Background())
	if err := l.Extend(ctx, ls); err != nil {
		t.Fatalf("extend: %v", err)
	}
	cancel() // as the keeper does after each round
	if !waitFor(3*time.Second, func() bool { return heldBy(rs[0], key) == 1 }) {
		t.Fatal("the restarted member did not get the lease back in this extension round")
	}
}

// TestLateExtensionDoesNotRecreateReleasedLease: a Redlock lease of two
// keys whose extension to one member (restarted empty) was still in flight,
// or whose answer was lost, when the lease was released: the extension
// that reaches the member after the release does not re-create the lease
// there. Before, keeper.stop returned while the call was on its way; the
// release found nothing on the member, and the late extension re-created
// the lease there for a whole ttl.
func TestLateExtensionDoesNotRecreateReleasedLease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		lost bool
	}{{"in flight", false}, {"answer lost", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rs := startServers(t, 3)
			o := testOptions()
			// Extensions every second; the fake clock keeps the lease valid
			// here however slow the machine, so only Redis decides.
			o.TTL, o.Timeout, o.Clock = 3*time.Second, 5*time.Second, newFakeClock()
			l, fcs := testLocker(t, rs, o)
			ctx := context.Background()
			keys := []string{"caddy:lock:{a}", "caddy:lock:{b}"}
			ls, err := l.Acquire(ctx, keys)
			if err != nil {
				t.Fatal(err)
			}
			rs[2].Restart() // the third member lost its state
			c := rs[2].Client()
			for _, sc := range []*redisconn.Script{extendScript, releaseScript} {
				c.ScriptLoad(ctx, sc.Source()) // so the late EVALSHA finds its script
			}
			// The third member's extensions are held back on their way: in
			// flight until the gate opens, or with their answer lost (they
			// land later, on a connection of their own).
			gate := make(chan struct{})
			var mu sync.Mutex
			var late [][]any
			var held, landed, released atomic.Int32
			fcs[2].setHook(func(cmd redis.Cmder, next func() error) error {
				switch s, _ := scriptCall(cmd); s {
				case extendScript:
					held.Add(1)
					if tc.lost {
						mu.Lock()
						late = append(late, heldArgs(cmd))
						mu.Unlock()
						cmd.SetErr(errLostAnswer)
						return errLostAnswer
					}
					_ = waitClosed(gate)
					err := next()
					if err == nil {
						landed.Add(1)
					}
					return err
				case releaseScript:
					err := next()
					released.Add(1)
					return err
				}
				return next()
			})
			k := ls.Keep(KeepOptions{Extend: true, OnLost: func(err error) { t.Errorf("lease lost: %v", err) }})
			if !waitFor(15*time.Second, func() bool { return held.Load() >= 2 }) {
				t.Fatalf("%d extensions held back on the third member, want 2 (one per key)", held.Load())
			}
			k.Stop()
			n := held.Load()
			ls.Release()
			// The release has reached the third member (before the extensions).
			if !waitFor(5*time.Second, func() bool { return released.Load() >= 2 }) {
				t.Fatal("the release did not reach the third member")
			}
			close(gate)
			var answers []any
			if tc.lost {
				mu.Lock()
				for _, args := range late {
					v, err := c.Do(ctx, args...).Result()
					if err != nil {
						t.Fatalf("a late extension: %v", err)
					}
					answers = append(answers, v)
				}
				mu.Unlock()
			} else if !waitFor(5*time.Second, func() bool { return landed.Load() == n }) {
				t.Fatalf("%d of %d extensions in flight reached the third member", landed.Load(), n)
			}
			for _, key := range keys {
				if n := heldBy(rs[2], key); n != 0 {
					t.Errorf("%s: the late extension re-created the released lease on the restarted member (answers %v, PTTL %v)",
						key, answers, c.PTTL(ctx, key).Val())
				}
			}
		})
	}
}

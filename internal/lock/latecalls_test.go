package lock

// Calls that reach Redis after their caller gave up on them (held back on
// their way, or their answer lost) take nothing: the undo or the release
// marked their token dead there.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestUndoMarksEveryUnknownKeyDead: a Redlock attempt on keys {a, b} whose
// answer for a was lost on the third server (the acquire still on its way
// there) and that then found b busy everywhere: its undo marks the token
// dead for a on every server, so the acquire that reaches the third server
// late takes nothing. Before, the undo passed only b's unknown flag (false),
// and a stayed held there for the ttl by a token nobody owned.
func TestUndoMarksEveryUnknownKeyDead(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	o := testOptions()
	o.TTL = 20 * time.Second
	l, fcs := testLocker(t, rs, o)
	ctx := context.Background()
	ka, kb := "caddy:lock:{a}", "caddy:lock:{b}"
	for _, r := range rs { // a rival holds b everywhere
		r.Client().ZAdd(ctx, kb, redisZ(time.Now().Add(time.Minute), "rival"))
	}
	// The third server's acquire of a is held back on its way (the caller
	// sees its answer lost); it lands once the attempt is over.
	var held atomic.Pointer[[]any]
	lost := make(chan struct{})
	var undone atomic.Bool
	fcs[2].setHook(func(cmd redis.Cmder, next func() error) error {
		s, _ := scriptCall(cmd)
		switch {
		case s == acquireScript && firstKey(cmd) == ka && held.Load() == nil:
			args := heldArgs(cmd)
			held.Store(&args)
			close(lost)
			cmd.SetErr(errLostAnswer)
			return errLostAnswer
		case s == releaseScript && firstKey(cmd) == ka:
			err := next()
			undone.Store(true)
			return err
		}
		return next()
	})
	// The other two answer b a little late: a's loss is known by then.
	for _, fc := range fcs[:2] {
		fc.setHook(func(cmd redis.Cmder, next func() error) error {
			if s, _ := scriptCall(cmd); s == acquireScript && firstKey(cmd) == kb {
				_ = waitClosed(lost)
				time.Sleep(100 * time.Millisecond) // a slow answer, not a wait for a state
			}
			return next()
		})
	}
	if _, err := l.Acquire(ctx, []string{ka, kb}); !errors.Is(err, ErrNotObtained) {
		t.Fatalf("b is held by a rival: %v, want ErrNotObtained", err)
	}
	if held.Load() == nil {
		t.Fatal("the acquire of a was never held back on the third server")
	}
	if !waitFor(10*time.Second, undone.Load) {
		t.Fatal("the undo never reached the third server")
	}
	ans, err := rs[2].Client().Do(ctx, (*held.Load())...).Result()
	if err != nil {
		t.Fatalf("the late acquire: %v", err)
	}
	if n := heldBy(rs[2], ka); n != 0 {
		pttl := rs[2].Client().PTTL(ctx, ka).Val()
		t.Fatalf("the late acquire holds a on the third server for a token nobody owns (answer %v, PTTL %v)", ans, pttl)
	}
	if !allFree(time.Second, ka, rs) {
		t.Fatal("a is still held somewhere after the attempt failed")
	}
}

// TestNoOrphanAfterLostAnswer: an acquire whose caller went away mid-call
// (Redis paused) leaves nothing held for longer than about a second after
// Redis answers again; a release that Redis did not answer is counted as
// a failure and sent again until it does.
func TestNoOrphanAfterLostAnswer(t *testing.T) {
	t.Parallel()
	t.Run("client gone mid-call", func(t *testing.T) {
		t.Parallel()
		rs := startServers(t, 1)
		o := testOptions()
		o.Timeout, o.Wait = time.Second, 10*time.Second // the caller goes at 200ms, within the call
		l, _ := testLocker(t, rs, o)
		key := "caddy:lock:{/gone}"
		warm, err := l.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatal(err)
		}
		warm.Release()
		rs[0].Pause()
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		_, err = l.Acquire(ctx, []string{key})
		cancel()
		if err == nil {
			t.Fatal("acquired with Redis paused")
		}
		rs[0].Resume()
		if !allFree(3*time.Second, key, rs) {
			t.Fatal("the lease of a caller that went away mid-call is still held 3s after Redis answered again")
		}
	})
	t.Run("release not answered", func(t *testing.T) {
		t.Parallel()
		rs := startServers(t, 1)
		o := testOptions()
		o.Timeout = 300 * time.Millisecond
		l, fcs := testLocker(t, rs, o)
		var failures, sent atomic.Int32
		l.servers[0].OnReleaseFailure(func(string) { failures.Add(1) })
		fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
			if s, _ := scriptCall(cmd); s == releaseScript {
				sent.Add(1)
			}
			return next()
		})
		key := "caddy:lock:{/rel}"
		ls, err := l.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatal(err)
		}
		rs[0].Pause()
		ls.Release()
		// Sent again while Redis still does not answer.
		again := waitFor(10*time.Second, func() bool { return sent.Load() >= 2 })
		rs[0].Resume()
		if !again {
			t.Fatalf("the release was sent %d times while Redis did not answer, want it sent again", sent.Load())
		}
		if !allFree(3*time.Second, key, rs) {
			t.Fatal("a release Redis did not answer was not retried: the key is still held 3s after Redis answered again")
		}
		if failures.Load() == 0 {
			t.Error("the failed release was not counted")
		}
	})
}

// TestNoOrphanAfterDelayedAcquire: an acquire that reaches Redis only after
// its caller gave up on it and undid it (held back on its way past the
// timeout) takes nothing: the undo marked its token dead. Before, one that
// landed after the undo's confirmation left the key held for its whole ttl
// by a token nobody owns.
func TestNoOrphanAfterDelayedAcquire(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		releases int32 // of the undo, answered before the acquire lands
	}{{"lands before the undo's confirmation", 1}, {"lands after the undo's confirmation", 2}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rs := startServers(t, 1)
			o := testOptions()
			o.TTL = 20 * time.Second
			l, fcs := testLocker(t, rs, o)
			ctx := context.Background()
			key := "caddy:lock:{/pay}"
			var held atomic.Pointer[[]any]
			var releases atomic.Int32
			fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
				switch s, _ := scriptCall(cmd); {
				case s == acquireScript && held.Load() == nil:
					args := heldArgs(cmd)
					held.Store(&args)
					cmd.SetErr(errLostAnswer) // on its way: the caller sees a timeout
					return errLostAnswer
				case s == releaseScript:
					err := next()
					releases.Add(1)
					return err
				}
				return next()
			})
			if _, err := l.Acquire(ctx, []string{key}); err == nil {
				t.Fatal("an acquire held back past the timeout succeeded")
			}
			if !waitFor(10*time.Second, func() bool { return releases.Load() >= tc.releases }) {
				t.Fatalf("the undo sent %d releases, want %d", releases.Load(), tc.releases)
			}
			if _, err := rs[0].Client().Do(ctx, (*held.Load())...).Result(); err != nil {
				t.Fatalf("the late acquire: %v", err)
			}
			if !allFree(time.Second, key, rs) {
				pttl, _ := rs[0].Client().PTTL(ctx, key).Result()
				t.Fatalf("the key is held by a lost acquisition nobody owns (PTTL %v)", pttl)
			}
			dead := rs[0].Client().PTTL(ctx, DeadKey(key)).Val()
			if dead <= 0 || dead > 2*o.TTL+releaseGiveUpExtra {
				t.Errorf("the dead-token set's PTTL is %v, want an expiry of at most 2 × ttl + %v", dead, releaseGiveUpExtra)
			}
			// The key is usable at once by a new attempt.
			ls, err := l.Acquire(ctx, []string{key})
			if err != nil {
				t.Fatalf("after the lost acquisition: %v", err)
			}
			ls.Release()
		})
	}
}

// TestDeadTokensOutliveShorterUndos: the dead-token set lives as long as
// its longest-lived token: handlers with other ttls may share a key, and
// an undo of the shorter one must not cut the other's mark short.
func TestDeadTokensOutliveShorterUndos(t *testing.T) {
	t.Parallel()
	r := startServers(t, 1)[0]
	ctx := context.Background()
	c := r.Client()
	key := "caddy:lock:{x}"
	keys := []string{key, FenceKey(key), ReplayKey(key), WaitqKey(key), DeadKey(key), DelayKey(key)}
	for _, undo := range []struct {
		token string
		ttlMs int64
	}{{"A", 300000}, {"B", 1000}} { // ttl 5m, then 1s
		if err := releaseScript.Run(ctx, c, keys, undo.token, "", "", 0, undo.ttlMs, "", 0, "x", 2*undo.ttlMs+releaseGiveUpExtra.Milliseconds(), "0", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	until := c.ZScore(ctx, DeadKey(key), "A").Val()
	left := time.Duration(int64(until)-c.Time(ctx).Val().UnixMilli()) * time.Millisecond
	if pttl := c.PTTL(ctx, DeadKey(key)).Val(); pttl < left-time.Second {
		t.Fatalf("token A must stay dead %v more, but the set expires in %v", left.Round(time.Second), pttl.Round(time.Second))
	}
}

// TestNoOrphanOnRedlockMinority: a Redlock lease granted by a majority while
// the third server's acquire was held back: the lease's release marks the
// token dead on every server, so that acquire, reaching the third server
// after the release, takes nothing there. Before, it held the key on that
// server for the whole ttl (one more failure would then leave no majority).
func TestNoOrphanOnRedlockMinority(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	o := testOptions()
	o.TTL = 20 * time.Second
	l, fcs := testLocker(t, rs, o)
	ctx := context.Background()
	key := "caddy:lock:{/pay}"
	var held atomic.Pointer[[]any]
	lost := make(chan struct{})
	fcs[2].setHook(func(cmd redis.Cmder, next func() error) error {
		if s, _ := scriptCall(cmd); s == acquireScript && held.Load() == nil {
			args := heldArgs(cmd)
			held.Store(&args)
			close(lost)
			cmd.SetErr(errLostAnswer) // on its way: the caller sees a timeout
			return errLostAnswer
		}
		return next()
	})
	ls, err := l.Acquire(ctx, []string{key})
	if err != nil {
		t.Fatalf("two of three servers answer: %v", err)
	}
	if waitClosed(lost) != nil { // the third server's call has failed, the lease is held
		t.Fatal("the third server's acquire was never held back")
	}
	ls.Release()
	if _, err := rs[2].Client().Do(ctx, (*held.Load())...).Result(); err != nil {
		t.Fatalf("the late acquire: %v", err)
	}
	if !allFree(time.Second, key, rs) {
		pttl, _ := rs[2].Client().PTTL(ctx, key).Result()
		t.Fatalf("the third server holds the key for a token nobody owns (PTTL %v)", pttl)
	}
}

package lock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testclock"
	"github.com/redis/go-redis/v9"
)

// fakeClock is a Clock that moves only when a test moves it.
type fakeClock = testclock.Fake

func newFakeClock() *fakeClock { return testclock.New() }

// slowCalls makes every call of script on fcs take d on the clock (the
// first call that reaches it, for a fan-out in parallel).
func slowCalls(fcs []*faultClient, clock *fakeClock, script func() bool, d time.Duration) {
	var once sync.Once
	for _, fc := range fcs {
		fc.setHook(func(cmd redis.Cmder, next func() error) error {
			err := next()
			if script() {
				if s, _ := scriptCall(cmd); s != nil {
					once.Do(func() { clock.Advance(d) })
				}
			}
			return err
		})
	}
}

// TestLeaseValidity: a lease's validity, counted from when its attempt
// began, is ttl − the time the attempt took and, with Redlock, − drift (1%
// of ttl + 2ms); an attempt that took the
// whole validity is no lease, and its grants are given back at once.
func TestLeaseValidity(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 3} {
		rs := startServers(t, n)
		clock := newFakeClock()
		o := testOptions()
		o.Clock = clock
		l, fcs := testLocker(t, rs, o)
		drift := time.Duration(0)
		if n > 1 {
			drift = o.TTL/100 + 2*time.Millisecond
		}
		if l.drift() != 300*time.Millisecond+2*time.Millisecond {
			t.Errorf("drift of a 30s ttl: %s, want 302ms", l.drift())
		}
		var on bool
		slowCalls(fcs, clock, func() bool { return on }, 250*time.Millisecond)
		on = true
		key := "caddy:lock:{validity}"
		asked := clock.Now()
		ls, err := l.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatalf("%d servers: %v", n, err)
		}
		if got, want := ls.validUntil().Sub(asked), o.TTL-250*time.Millisecond-drift; got != want {
			t.Errorf("%d servers: the lease ends %s after it was asked for, want ttl − 250ms elapsed − drift %s = %s", n, got, drift, want)
		}
		// An extension that took 100ms: ttl − 100ms − drift from its start.
		slowCalls(fcs, clock, func() bool { return true }, 100*time.Millisecond)
		asked = clock.Now()
		if err := l.Extend(context.Background(), ls); err != nil {
			t.Fatalf("%d servers: extend: %v", n, err)
		}
		if got, want := ls.validUntil().Sub(asked), o.TTL-100*time.Millisecond-drift; got != want {
			t.Errorf("%d servers: validity after an extension %s, want %s", n, got, want)
		}
		// An extension answered after the validity ended is a lost lease.
		slowCalls(fcs, clock, func() bool { return true }, o.TTL)
		if err := l.Extend(context.Background(), ls); !errors.Is(err, ErrLeaseLost) {
			t.Errorf("%d servers: an extension answered after the validity ended: %v, want ErrLeaseLost", n, err)
		}
		ls.Release()
		if !allFree(5*time.Second, key, rs) {
			t.Fatalf("%d servers: not released", n)
		}

		// An attempt that took the whole validity takes nothing.
		slowCalls(fcs, clock, func() bool { return true }, o.TTL-drift)
		if ls, err := l.Acquire(context.Background(), []string{key}); !errors.Is(err, ErrNotObtained) {
			t.Errorf("%d servers: an attempt that outlasted its validity: %v %v, want ErrNotObtained", n, ls, err)
		}
		if !allFree(5*time.Second, key, rs) {
			t.Errorf("%d servers: the grants of an attempt that outlasted its validity were kept", n)
		}
	}
}

// TestKeeperSchedule: the keeper extends every ttl/3, sooner when a
// handed-on lease has less left (half of what is left), and after max_hold
// only waits for the validity to end.
func TestKeeperSchedule(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	l := &Locker{opts: Options{TTL: 30 * time.Second, Clock: clock}}
	ls := &Lease{l: l, start: clock.Now(), until: clock.Now().Add(29 * time.Second)}
	k := &keeper{ls: ls, extend: true, maxHold: 20 * time.Second}
	if got := k.next(); got != 10*time.Second {
		t.Errorf("a fresh lease: next extension in %s, want ttl/3 = 10s", got)
	}
	clock.Advance(21 * time.Second) // 8s left
	if got := k.next(); got != 8*time.Second {
		t.Errorf("after max_hold: next event in %s, want the validity left, 8s", got)
	}
	k.maxHold = 0
	if got := k.next(); got != 4*time.Second {
		t.Errorf("8s left: next extension in %s, want half of it, 4s", got)
	}
	k.extend = false
	clock.Advance(10 * time.Second)
	if got := k.next(); got != 0 {
		t.Errorf("an ended lease without extension: next event in %s, want 0 (reported lost)", got)
	}
}

// TestBackoffBounds: the n-th poll waits uniformly in
// [min, min(max, min·2^n)].
func TestBackoffBounds(t *testing.T) {
	t.Parallel()
	l := &Locker{opts: Options{BackoffMin: 10 * time.Millisecond, BackoffMax: 500 * time.Millisecond}}
	for n := 0; n < 10; n++ {
		hi := min(10*time.Millisecond<<n, 500*time.Millisecond)
		var top time.Duration
		for range 2000 {
			d := l.backoff(n)
			if d < 10*time.Millisecond || d > hi {
				t.Fatalf("backoff(%d) = %s, outside [10ms, %s]", n, d, hi)
			}
			top = max(top, d)
		}
		if n > 0 && top < 10*time.Millisecond+(hi-10*time.Millisecond)*9/10 {
			t.Errorf("backoff(%d): highest of 2000 draws %s, want near %s (full jitter)", n, top, hi)
		}
	}
}

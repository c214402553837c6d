package lock

// A lease whose holder never releases it (it crashed) ends with its ttl in
// Redis; with lock_delay, nobody gets the keys for that long after.

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// TestHolderDiesTakenOverAfterTTL: a holder that stops extending and never
// releases (a crashed process) blocks the key for at most its ttl.
func TestHolderDiesTakenOverAfterTTL(t *testing.T) {
	t.Parallel()
	o := testOptions()
	o.TTL, o.Wait, o.BackoffMax = time.Second, 10*time.Second, 500*time.Millisecond
	l, _ := testLocker(t, startServers(t, 1), o)
	keys := []string{"caddy:lock:{/crash}"}
	if _, err := l.Acquire(context.Background(), keys); err != nil {
		t.Fatal(err)
	} // never extended, never released: the holder "crashed"
	start := time.Now()
	ls, err := l.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatalf("%v, want the lock after the dead holder's ttl", err)
	}
	ls.Release()
	if el := time.Since(start); el < 700*time.Millisecond || el > 8*time.Second {
		t.Errorf("took over after %s; want about the 1s ttl", el)
	}
}

// lockDelay is the lock_delay of these tests.
const lockDelay = 1500 * time.Millisecond

// TestLockDelayAfterExpiry: a holder that never releases (it crashed)
// keeps the key until its lease ends and then lock_delay longer; the
// waiter, queued all along, gets it then (it does not sleep until its wait
// runs out) — on one server and on a Redlock.
func TestLockDelayAfterExpiry(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, rs []*testredis.Server) {
		const ttl = 800 * time.Millisecond
		o := testOptions()
		o.TTL, o.LockDelay = ttl, lockDelay
		crashed, _ := testLocker(t, rs, o) // another ttl: another local queue
		o.TTL, o.Wait = 30*time.Second, 10*time.Second
		l, _ := testLocker(t, rs, o)
		key := "caddy:lock:{/exp}"
		asked := time.Now()
		ls, err := crashed.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatal(err)
		}
		defer ls.Release() // long after its expiry: it finds nothing
		waiter, err := l.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatalf("the waiter: %v, want the lock once the delay ended (before its 10s wait ran out)", err)
		}
		got := time.Now()
		waiter.Release()
		if earliest := asked.Add(ttl + lockDelay); got.Before(earliest) {
			t.Errorf("the waiter got the lock %s after the lease expired; want at least lock_delay %s", got.Sub(asked.Add(ttl)), lockDelay)
		}
	})
}

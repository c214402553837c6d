package lock

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestHandOffNow: HandOffNow passes a lease on to a waiter of this
// instance at once, with no Redis call and the next token, when the lease
// can go on (it reserved tokens for its waiters); otherwise the lock stays
// held and queued as it was, and the release call that follows sends the
// release it announced. After a hand-off or a release, neither does
// anything more.
func TestHandOffNow(t *testing.T) {
	rs := startServers(t, 1)
	// A waiter behind a holder of this instance polls Redis only as a
	// safety net, every backoff_max: long here, so no poll falls among the
	// hand-off's calls.
	l, fcs := testLocker(t, rs, Options{TTL: 30 * time.Second, Wait: 20 * time.Second, BackoffMin: 10 * time.Millisecond,
		BackoffMax: 10 * time.Second, Permits: 1, Timeout: 2 * time.Second})
	var calls atomic.Int64
	fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
		calls.Add(1)
		return next()
	})
	ctx := context.Background()

	first, err := l.Acquire(ctx, []string{"k"})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Lease, 2)
	for i := 0; i < 2; i++ {
		go func() {
			ls, err := l.Acquire(ctx, []string{"k"})
			if err != nil {
				t.Errorf("waiter: %v", err)
			}
			got <- ls
		}()
	}
	if !waitFor(5*time.Second, func() bool { return first.q.waiting() == 2 }) {
		t.Fatal("the two acquires never queued behind the first")
	}
	next := func() *Lease {
		t.Helper()
		select {
		case ls := <-got:
			if ls == nil {
				t.FailNow()
			}
			return ls
		case <-time.After(5 * time.Second):
			t.Fatal("no waiter got the lease")
			return nil
		}
	}

	// Granted with nobody waiting, the first lease reserved no token for a
	// next holder: it cannot be handed on; the key stays held and its
	// waiters queued until the release call.
	if first.HandOffNow() {
		t.Fatal("a lease without reserved tokens was handed on")
	}
	if heldBy(rs[0], "k") == 0 || first.q.waiting() != 2 {
		t.Fatal("a HandOffNow that handed nothing on freed the key or dropped a waiter")
	}
	first.ReleaseInBackground("")
	second := next()

	// The second was granted with a waiter behind it: handed on at once.
	// The waiter behind it may have asked Redis once while the second's
	// grant was on its way back (it headed the queue before the grant was
	// noted): let its calls settle before counting the hand-off's.
	quiet := func() bool {
		n := calls.Load()
		time.Sleep(200 * time.Millisecond)
		return calls.Load() == n
	}
	if !waitFor(5*time.Second, quiet) {
		t.Fatal("Redis calls never settled while the second held the lease")
	}
	before := calls.Load()
	if !second.HandOffNow() {
		t.Fatal("HandOffNow with a waiter and reserved tokens: not handed on")
	}
	third := next()
	if n := calls.Load() - before; n != 0 {
		t.Errorf("the hand-off sent %d Redis calls, want none", n)
	}
	if third.Fence() != second.Fence()+1 {
		t.Errorf("next holder's token %d, want %d", third.Fence(), second.Fence()+1)
	}
	second.ReleaseInBackground("") // handed on already: nothing happens
	if second.HandOffNow() {
		t.Error("a second HandOffNow after a hand-off reported one")
	}
	if heldBy(rs[0], "k") == 0 {
		t.Fatal("the release after a hand-off freed the key the next holder holds")
	}

	// Nobody waits: nothing changes, and the release frees the key.
	if third.HandOffNow() {
		t.Fatal("HandOffNow without a waiter reported a hand-off")
	}
	third.ReleaseInBackground("")
	if !allFree(5*time.Second, "k", rs) {
		t.Fatal("the release after a HandOffNow that did nothing left the key held")
	}
	if third.HandOffNow() {
		t.Fatal("HandOffNow after the release reported a hand-off")
	}
}

// TestHandOffNowAnnounces: a HandOffNow that hands nothing on announces the
// release its holder sends later, so a request of this instance for the key
// that comes in between waits for it before its first attempt, also with
// wait 0 (a client's next request never finds its own previous one holding
// the lock), and gets the key once it is sent.
func TestHandOffNowAnnounces(t *testing.T) {
	rs := startServers(t, 1)
	l, _ := testLocker(t, rs, Options{TTL: 30 * time.Second, Wait: 0, BackoffMin: 10 * time.Millisecond,
		BackoffMax: 100 * time.Millisecond, Permits: 1, Timeout: 2 * time.Second})
	ctx := context.Background()
	first, err := l.Acquire(ctx, []string{"k"})
	if err != nil {
		t.Fatal(err)
	}
	if first.HandOffNow() {
		t.Fatal("handed on with nobody waiting")
	}
	got := make(chan error, 1)
	go func() {
		ls, err := l.Acquire(ctx, []string{"k"})
		if err == nil {
			ls.ReleaseInBackground("")
		}
		got <- err
	}()
	time.Sleep(100 * time.Millisecond) // the second request is waiting by now, not refused
	select {
	case err := <-got:
		t.Fatalf("the next request did not wait for the announced release: %v", err)
	default:
	}
	first.ReleaseInBackground("")
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("the next request after the release: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the next request never got the key")
	}
}

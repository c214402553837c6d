package lock

import (
	"context"
	"testing"
	"time"
)

// TestHandOffUsesReceiversOptions: two lockers on the same servers and key
// but with another ttl do not hand leases to each other: a waiter always
// holds a lease of its own locker's ttl.
func TestHandOffUsesReceiversOptions(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	opts := func(ttl time.Duration) Options {
		o := testOptions()
		o.TTL, o.Wait = ttl, 10*time.Second
		return o
	}
	blocker, _ := testInstance(t, "blocker", rs, opts(30*time.Second))
	long, _ := testLocker(t, rs, opts(30*time.Second))
	short, _ := testLocker(t, rs, opts(2*time.Second))
	keys := []string{"caddy:lock:{/ttl}"}
	held, err := blocker.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	// Two waiters of the long locker and one of the short one queue while
	// the key is held elsewhere, so the first of them to get it reserves a
	// block of tokens for hand-offs.
	type got struct {
		ls    *Lease
		pttl  time.Duration
		short bool
	}
	res := make(chan got, 3)
	acquire := func(l *Locker) {
		ls, err := l.Acquire(context.Background(), keys)
		if err != nil {
			t.Errorf("acquire: %v", err)
			res <- got{}
			return
		}
		pttl, _ := rs[0].Client().PTTL(context.Background(), keys[0]).Result()
		time.Sleep(20 * time.Millisecond) // held a moment, as a request would
		res <- got{ls, pttl, l == short}
		ls.Release()
	}
	// Each queued before the next comes (the state, not a sleep).
	queued := func(l *Locker, n int) {
		t.Helper()
		if !waitFor(15*time.Second, func() bool { return l.waitersFor(keys[0]) >= n }) {
			t.Fatalf("%d waiters of ttl %s queued within 15s, want %d", l.waitersFor(keys[0]), l.opts.TTL, n)
		}
	}
	go acquire(long)
	queued(long, 1)
	go acquire(long)
	queued(long, 2)
	go acquire(short)
	queued(short, 1)
	held.Release()
	for i := 0; i < 3; i++ {
		select {
		case g := <-res:
			if g.ls == nil {
				t.Fatal("a waiter got no lease")
			}
			if g.short && g.pttl > 2*time.Second {
				t.Errorf("a request of the short locker (ttl 2s) held a lease of %s in Redis", g.pttl)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("waiter not served")
		}
	}
}

package lock

import (
	"context"
	"testing"
	"time"
)

// A queue of one key is one allocation besides its wake message, and its
// wake entry survives a second queue of the same key coming and going in
// either order.
func TestQueueOfOneKey(t *testing.T) {
	d := acquireDomain("test-queue-of-one-key")
	defer releaseDomain(d)
	keys := []string{"caddy:lock:{/orders/42}"}
	if n := testing.AllocsPerRun(100, func() { d.putQueue(d.queue(keys)) }); n > 2 {
		t.Fatalf("queue of one key: %v allocations, want at most 2", n)
	}
	w := WakeID(keys[0])
	both := []string{keys[0], "caddy:lock:{/orders/43}"}
	for _, firstGoesFirst := range []bool{true, false} {
		q1 := d.queue(keys)
		q2 := d.queue(both)
		if got := d.byWake[w]; len(got) != 2 || got[0] != q1 || got[1] != q2 {
			t.Fatalf("byWake after two queues: %v", got)
		}
		if firstGoesFirst {
			d.putQueue(q1)
			if got := d.byWake[w]; len(got) != 1 || got[0] != q2 {
				t.Fatalf("byWake after the first left: %v", got)
			}
			d.putQueue(q2)
		} else {
			d.putQueue(q2)
			if got := d.byWake[w]; len(got) != 1 || got[0] != q1 {
				t.Fatalf("byWake after the second left: %v", got)
			}
			d.putQueue(q1)
		}
		if _, ok := d.byWake[w]; ok || len(d.queues) != 0 {
			t.Fatalf("queues left: %v, %v", d.byWake, d.queues)
		}
	}
}

// A waiter goes back for reuse empty: no wake-up or grant of its last
// request is left in it (leave takes the grant, recycle the wake-up).
func TestWaiterRecycledEmpty(t *testing.T) {
	d := acquireDomain("test-waiter-recycled")
	defer releaseDomain(d)
	q := d.queue([]string{"caddy:lock:{/orders/42}"})
	defer d.putQueue(q)
	w, ok := q.enqueue(0)
	if !ok {
		t.Fatal("enqueue refused")
	}
	q.wakeHead()
	granted := &Lease{}
	w.grant <- granted
	if got := q.leave(w); got != granted {
		t.Fatalf("leave returned %p, want the grant %p", got, granted)
	}
	w.recycle()
	if len(w.wake) != 0 || len(w.grant) != 0 || w.q != nil || w.turn != nil {
		t.Fatalf("recycled waiter not empty: wake %d, grant %d, queue %v, turn %v", len(w.wake), len(w.grant), w.q, w.turn)
	}
}

// TestLeaseKeepsItsQueue: the first holder of a quiet key keeps its local
// queue until it releases, so a waiter that arrives later queues behind it
// (where the hand-off and heldLocally look) instead of in a fresh queue.
func TestLeaseKeepsItsQueue(t *testing.T) {
	t.Parallel()
	o := testOptions()
	o.Wait = 10 * time.Second
	l, _ := testLocker(t, startServers(t, 1), o)
	keys := []string{"caddy:lock:{/quiet}"}
	ls, err := l.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Lease, 1)
	go func() {
		l2, err := l.Acquire(context.Background(), keys)
		if err != nil {
			t.Errorf("waiter: %v", err)
		}
		got <- l2
	}()
	if !waitFor(5*time.Second, func() bool { return ls.q.waiting() == 1 }) {
		t.Fatalf("the later waiter did not queue in the holder's queue (holder's queue has %d waiters)", ls.q.waiting())
	}
	if !ls.q.heldLocally(1) {
		t.Fatal("the holder's queue does not know the lock is held here")
	}
	ls.Release()
	select {
	case l2 := <-got:
		if l2 == nil {
			t.Fatal("waiter got no lease")
		}
		l2.Release()
	case <-time.After(10 * time.Second):
		t.Fatal("waiter not served within 10s of the release")
	}
	if n := l.queueCount(); n != 0 {
		t.Fatalf("%d queues left in the domain after every lease was released", n)
	}
}

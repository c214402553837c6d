package lock

import (
	"testing"

	"github.com/google/uuid"
)

// keyNames makes, in one allocation, the same names as the functions
// that name each companion key.
func TestKeyNames(t *testing.T) {
	for _, k := range []string{"caddy:lock:{/a}", "", "k:{x}:y:fence"} {
		got := keyNames(k)
		want := names{lease: k, fence: FenceKey(k), waitq: WaitqKey(k), replay: ReplayKey(k), dead: DeadKey(k), delay: DelayKey(k)}
		if got != want {
			t.Fatalf("keyNames(%q) = %+v, want %+v", k, got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = keyNames("caddy:lock:{/orders/42}") }); n != 1 {
		t.Fatalf("keyNames: %v allocations, want 1", n)
	}
}

// wakeIDAndMessage makes, in one allocation, what WakeID and wakeMessage
// make, also for a domain id longer than its stack buffer.
func TestWakeIDAndMessage(t *testing.T) {
	long := string(make([]byte, 100))
	for _, id := range []string{"4f1c9d3e-8a53-4a7e-9a47-1d2b3c4d5e6f", "", long} {
		for _, k := range []string{"caddy:lock:{/a}", "", "k:{x}:y"} {
			w, msg := wakeIDAndMessage(id, k)
			if w != WakeID(k) || msg != wakeMessage(id, WakeID(k)) {
				t.Fatalf("wakeIDAndMessage(%q, %q) = %q, %q; want %q, %q", id, k, w, msg, WakeID(k), wakeMessage(id, WakeID(k)))
			}
		}
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = wakeIDAndMessage("4f1c9d3e-8a53-4a7e-9a47-1d2b3c4d5e6f", "caddy:lock:{/orders/42}") }); n != 1 {
		t.Fatalf("wakeIDAndMessage: %v allocations, want 1", n)
	}
}

// newToken is a random version-4 UUID, in one allocation, never the same
// twice.
func TestNewToken(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 1000; i++ {
		tok := newToken()
		u, err := uuid.Parse(tok)
		if err != nil || u.Version() != 4 || u.Variant() != uuid.RFC4122 || u.String() != tok {
			t.Fatalf("newToken() = %q: %v, version %v, variant %v", tok, err, u.Version(), u.Variant())
		}
		if seen[tok] {
			t.Fatalf("newToken() repeated %q", tok)
		}
		seen[tok] = true
	}
	// The race detector's instrumentation moves the UUID to the heap.
	if n := testing.AllocsPerRun(100, func() { _ = newToken() }); n != 1 && !raceEnabled {
		t.Fatalf("newToken: %v allocations, want 1", n)
	}
}

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

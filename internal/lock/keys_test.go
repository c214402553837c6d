package lock

import (
	"testing"

	"github.com/google/uuid"
)

// keyNames makes, in one allocation, the same names as the functions
// that name each companion key.
func TestKeyNames(t *testing.T) {
	for _, k := range []string{"caddy:lock:{/a}", "", "k:{x}:y:fence"} {
		ks := keyNames(k)
		if got, want := ks.acquireKeyArray(), [6]string{k, FenceKey(k), WaitqKey(k), ReplayKey(k), DeadKey(k), DelayKey(k)}; got != want {
			t.Fatalf("keyNames(%q).acquireKeyArray() = %q, want %q", k, got, want)
		}
		if got, want := ks.releaseKeyArray(), [6]string{k, FenceKey(k), ReplayKey(k), WaitqKey(k), DeadKey(k), DelayKey(k)}; got != want {
			t.Fatalf("keyNames(%q).releaseKeyArray() = %q, want %q", k, got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = keyNames("caddy:lock:{/orders/42}") }); n != 1 {
		t.Fatalf("keyNames: %v allocations, want 1", n)
	}
}

// wakeIDAndMessage makes, in one allocation, WakeID and the wake-up
// "<domain id> <WakeID>", also for a domain id longer than its stack buffer.
func TestWakeIDAndMessage(t *testing.T) {
	long := string(make([]byte, 100))
	for _, id := range []string{"4f1c9d3e-8a53-4a7e-9a47-1d2b3c4d5e6f", "", long} {
		for _, k := range []string{"caddy:lock:{/a}", "", "k:{x}:y"} {
			w, msg := wakeIDAndMessage(id, k)
			if w != WakeID(k) || msg != id+" "+WakeID(k) {
				t.Fatalf("wakeIDAndMessage(%q, %q) = %q, %q; want %q, %q", id, k, w, msg, WakeID(k), id+" "+WakeID(k))
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

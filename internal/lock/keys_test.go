package lock

import "testing"

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

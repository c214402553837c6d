package lock

import (
	"sync"
	"testing"
	"time"
)

// Work one job after the other reuses one goroutine; a burst gets a
// goroutine per job at once (none waits for another); after it at most
// kept stay, and an idle one ends.
func TestBackgroundWorkers(t *testing.T) {
	const kept = 4
	w := newWorkers(kept, 300*time.Millisecond)
	waitFor := func(what string, ok func(n int32) bool) {
		t.Helper()
		for end := time.Now().Add(10 * time.Second); !ok(w.n.Load()); {
			if time.Now().After(end) {
				t.Fatalf("%s: %d goroutines", what, w.n.Load())
			}
			time.Sleep(time.Millisecond)
		}
	}
	for i := 0; i < 50; i++ {
		done := make(chan struct{})
		w.Go(func() { close(done) })
		<-done
		// Back waiting for work before the next job (if it is still on its
		// way there, the next job starts a goroutine of its own).
		time.Sleep(2 * time.Millisecond)
	}
	if n := w.starts.Load(); n > 10 {
		t.Fatalf("50 jobs one after the other started %d goroutines, want them reused", n)
	}

	const burst = 5 * kept
	gate := make(chan struct{})
	var started sync.WaitGroup
	started.Add(burst)
	for i := 0; i < burst; i++ {
		w.Go(func() { started.Done(); <-gate })
	}
	ran := make(chan struct{})
	go func() { started.Wait(); close(ran) }()
	select {
	case <-ran: // every job of the burst runs at once
	case <-time.After(10 * time.Second):
		t.Fatal("the jobs of a burst did not all start at once")
	}
	close(gate)
	waitFor("after the burst", func(n int32) bool { return n <= kept })
	waitFor("idle", func(n int32) bool { return n == 0 })
}

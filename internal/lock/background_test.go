package lock

import (
	"sync"
	"testing"
	"time"
)

// Background work one after the other reuses one goroutine; a burst gets
// a goroutine per job at once (none waits for another), and after it at
// most backgroundKept stay.
func TestBackgroundGoroutines(t *testing.T) {
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for end := time.Now().Add(10 * time.Second); !ok(); {
			if time.Now().After(end) {
				t.Fatalf("%s: %d background goroutines", what, backgroundWorkers.Load())
			}
			time.Sleep(time.Millisecond)
		}
	}
	base := backgroundWorkers.Load()
	for i := 0; i < 50; i++ {
		done := make(chan struct{})
		goBackground(func() { close(done) })
		<-done
		// The goroutine is back waiting for work before the next job.
		waitFor("sequential", func() bool { return backgroundWorkers.Load() <= base+1 })
	}
	if n := backgroundWorkers.Load(); n > base+1 {
		t.Fatalf("50 jobs one after the other: %d goroutines, want at most %d", n, base+1)
	}

	const burst = 3 * backgroundKept
	gate := make(chan struct{})
	var started sync.WaitGroup
	started.Add(burst)
	for i := 0; i < burst; i++ {
		goBackground(func() { started.Done(); <-gate })
	}
	ran := make(chan struct{})
	go func() { started.Wait(); close(ran) }()
	select {
	case <-ran: // every job of the burst runs at once
	case <-time.After(10 * time.Second):
		t.Fatal("the jobs of a burst did not all start at once")
	}
	close(gate)
	waitFor("after the burst", func() bool { return backgroundWorkers.Load() <= backgroundKept })
}

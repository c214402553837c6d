package lock

// Background work of a request that has answered (its lease's release in
// Redis) runs on a few long-lived goroutines rather than on a new one per
// request: a new goroutine starts on a small stack, which the release's
// call depth (fan-out, script, pipe, go-redis) grew again every time
// (runtime.newstack and copystack: 4% of Caddy's CPU for sequential locked
// requests, 2% under 64 concurrent ones).

import (
	"sync/atomic"
	"time"
)

// workers runs functions on long-lived goroutines: an idle one takes the
// next function, or a new one starts when none is idle (Go never waits).
// After a burst at most kept of them stay, each until it was idle for idle.
type workers struct {
	jobs   chan func() // idle goroutines wait here
	n      atomic.Int32
	starts atomic.Int64 // goroutines started so far
	kept   int32
	idle   time.Duration
}

// background runs the process's background work (workers outlive configs).
var background = newWorkers(64, 10*time.Second)

func newWorkers(kept int32, idle time.Duration) *workers {
	return &workers{jobs: make(chan func()), kept: kept, idle: idle}
}

// Go runs f on an idle goroutine, or on a new one. f recovers its own
// panics.
func (w *workers) Go(f func()) {
	select {
	case w.jobs <- f:
	default:
		w.n.Add(1)
		w.starts.Add(1)
		go w.run(f)
	}
}

func (w *workers) run(f func()) {
	defer w.n.Add(-1)
	idle := time.NewTimer(w.idle)
	defer idle.Stop()
	for {
		f()
		if w.n.Load() > w.kept {
			return
		}
		idle.Reset(w.idle)
		select {
		case f = <-w.jobs:
		case <-idle.C:
			return
		}
	}
}

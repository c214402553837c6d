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

const (
	// backgroundIdle is how long an idle background goroutine waits for
	// work before it ends.
	backgroundIdle = 10 * time.Second
	// backgroundKept bounds the goroutines that wait for work: after a
	// burst, the rest end as soon as their work is done.
	backgroundKept = 64
)

var (
	backgroundJobs    = make(chan func()) // idle goroutines wait here
	backgroundWorkers atomic.Int32
)

// goBackground runs f on an idle background goroutine, or on a new one
// when none is idle: it never waits. f recovers its own panics.
func goBackground(f func()) {
	select {
	case backgroundJobs <- f:
	default:
		backgroundWorkers.Add(1)
		go backgroundWorker(f)
	}
}

func backgroundWorker(f func()) {
	defer backgroundWorkers.Add(-1)
	idle := time.NewTimer(backgroundIdle)
	defer idle.Stop()
	for {
		f()
		if backgroundWorkers.Load() > backgroundKept {
			return
		}
		idle.Reset(backgroundIdle)
		select {
		case f = <-backgroundJobs:
		case <-idle.C:
			return
		}
	}
}

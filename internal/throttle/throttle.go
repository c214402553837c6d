// Package throttle keeps repeated warnings out of the logs, for the
// handlers and the engines alike.
package throttle

import (
	"sync"
	"sync/atomic"
	"time"
)

// Warnings keeps repeated warnings out of the logs: a warning about a
// template is logged once, a warning about a fault at most once per
// interval (with the number of occurrences held back since the last one).
type Warnings struct {
	every time.Duration
	last  atomic.Int64 // unix nanos of the last fault warning
	held  atomic.Int64 // occurrences since then
	seen  sync.Map     // templates already warned about
}

// New makes Warnings that log a fault at most once per every.
func New(every time.Duration) *Warnings { return &Warnings{every: every} }

// First reports whether key is seen for the first time.
func (w *Warnings) First(key string) bool {
	_, seen := w.seen.LoadOrStore(key, true)
	return !seen
}

// Due reports whether a fault warning may be logged now and, if so, how
// many occurrences it stands for (this one included).
func (w *Warnings) Due() (bool, int64) {
	now := time.Now().UnixNano()
	last := w.last.Load()
	if now-last < int64(w.every) || !w.last.CompareAndSwap(last, now) {
		w.held.Add(1)
		return false, 0
	}
	return true, w.held.Swap(0) + 1
}

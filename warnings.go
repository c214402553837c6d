package redisdlm

import (
	"sync"
	"sync/atomic"
	"time"
)

// warnings keeps repeated warnings out of the logs: a warning about a
// template is logged once, a warning about a fault at most once per
// interval (with the number of occurrences held back since the last one).
type warnings struct {
	every time.Duration
	last  atomic.Int64 // unix nanos of the last fault warning
	held  atomic.Int64 // occurrences since then
	seen  sync.Map     // templates already warned about
}

func newWarnings(every time.Duration) *warnings { return &warnings{every: every} }

// first reports whether key is seen for the first time.
func (w *warnings) first(key string) bool {
	_, seen := w.seen.LoadOrStore(key, true)
	return !seen
}

// due reports whether a fault warning may be logged now and, if so, how
// many occurrences it stands for (this one included).
func (w *warnings) due() (bool, int64) {
	now := time.Now().UnixNano()
	last := w.last.Load()
	if now-last < int64(w.every) || !w.last.CompareAndSwap(last, now) {
		w.held.Add(1)
		return false, 0
	}
	return true, w.held.Swap(0) + 1
}

package lock

// What the handler's tests (package redislock) set and read of the engine
// beyond its API: they watch it under real Caddy configs.

import (
	"log/slog"
	"time"
)

// SetLogger replaces the locker's logger (a test quiets the one Caddy gives
// a module provisioned without a config, or records its lines).
func (l *Locker) SetLogger(lg *slog.Logger) { l.logger = lg }

// QueuedCalls is how many acquires and releases wait in the pipes of the
// locker's servers for a pipeline.
func (l *Locker) QueuedCalls() int {
	n := 0
	for _, s := range l.servers {
		n += s.pipe.Queued()
	}
	return n
}

// NewBusyError is the error of a lock not taken in time (wrapping err),
// with the holder's lease left, how long it has held the lock (<0:
// unknown), the requests ahead here and the other instances waiting.
func NewBusyError(err error, leaseLeft, held time.Duration, ahead, others int) *BusyError {
	return &BusyError{err: err, facts: busyFacts{at: time.Now(), leaseLeft: leaseLeft, held: held, others: others}, ahead: ahead}
}

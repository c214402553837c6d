package lock

// The engine's errors: sentinels, a busy lock, a stored answer.

import (
	"errors"
	"time"
)

// Sentinel errors of the lock engine; compare with errors.Is.
var (
	// ErrNotObtained: the lock stayed busy for the whole wait.
	ErrNotObtained = errors.New("redisdlm: lock not obtained")
	// ErrTooManyWaiters: max_waiters local waiters already queue for the key.
	ErrTooManyWaiters = errors.New("redisdlm: too many waiters")
	// ErrUnavailable: Redis (or a quorum of Redlock servers) could not be reached.
	ErrUnavailable = errors.New("redisdlm: redis unavailable")
	// ErrLeaseLost: an extension found that the lease is no longer held.
	ErrLeaseLost = errors.New("redisdlm: lease lost")
)

// BusyError is returned (wrapping ErrNotObtained or ErrTooManyWaiters) when
// the lock could not be taken in time. It carries what Redis said of the
// holder (its lease left, how long it has held the lock, the other
// instances waiting) and the requests of this instance that queued before
// this one: the handler estimates Retry-After from them.
type BusyError struct {
	err   error
	facts busyFacts
	ahead int
}

func (e *BusyError) Error() string { return e.err.Error() }

func (e *BusyError) Unwrap() error { return e.err }

// LeaseLeft is the time until the holder's lease ends (0 when unknown);
// with permits, the lease that ends first.
func (e *BusyError) LeaseLeft() time.Duration { return e.facts.leaseLeft }

// Held is how long the current holder has held the lock, by the Redis
// server's clock from the TIME of its grant (the holder may be on another
// instance); with permits, the holder granted first. Over a Redlock quorum
// it is the earliest grant among the servers that answered busy. false
// when unknown.
func (e *BusyError) Held() (time.Duration, bool) { return e.facts.held, e.facts.held >= 0 }

// Ahead is the requests of this instance that queued before this one.
func (e *BusyError) Ahead() int { return e.ahead }

// OthersWaiting is the other Caddy instances in the key's Redis wait list
// (each waits with at least one request).
func (e *BusyError) OthersWaiting() int { return e.facts.others }

// ErrRunMismatch: under replay, the key's run was started by another
// request (its fingerprint differs).
var ErrRunMismatch = errors.New("redisdlm: the key's run was started by another request")

// InDoubtError is what Acquire returns for a Run whose key was run already
// by a holder that no longer holds a live lease (paused or crashed past
// it, or force-released) and left no answer: that run may or may not
// have happened, so this one must not start.
type InDoubtError struct{ left time.Duration }

func (e *InDoubtError) Error() string {
	return "redisdlm: the key's run started earlier and its outcome is unknown (its holder lost its lease before an answer was stored)"
}

// RecordLeft is how long the run record that keeps the key in doubt still
// lives.
func (e *InDoubtError) RecordLeft() time.Duration { return e.left }

// Replayed is what Acquire returns when an earlier holder's answer is
// stored for the key: the request is answered with it, no lock is taken.
type Replayed struct{ answer string }

func (r *Replayed) Error() string { return "redisdlm: answered from a stored response" }

// Answer is the earlier holder's stored answer.
func (r *Replayed) Answer() string { return r.answer }

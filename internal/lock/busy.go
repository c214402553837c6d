package lock

// What a busy lock tells of itself, for the handler's Retry-After.

import "time"

// busyFacts is what Redis said of a busy lock, as of a moment.
type busyFacts struct {
	at        time.Time     // when it was said (this process's clock); zero: nothing known
	leaseLeft time.Duration // until the earliest lease ends (0: unknown)
	held      time.Duration // since the current holder's grant, by Redis's clock (<0: unknown)
	others    int           // other instances in the key's Redis wait list
}

// unknownBusy is what is known of a lock nobody asked Redis about.
var unknownBusy = busyFacts{held: -1}

// add takes in one busy server's {ms since the holder's grant (-1:
// unknown), other instances waiting}. Over a Redlock quorum the earliest
// grant counts (clock offsets do not matter: each server measures against
// its own clock), and the longest wait list.
func (f *busyFacts) add(v []int64) {
	if len(v) < 2 {
		return
	}
	if d := time.Duration(v[0]) * time.Millisecond; v[0] >= 0 && d > f.held {
		f.held = d
	}
	if n := int(v[1]); n > f.others {
		f.others = n
	}
}

// aged returns the facts as of now: the lease has run on, the holder has
// held the lock longer.
func (f busyFacts) aged() busyFacts {
	if f.at.IsZero() {
		return unknownBusy
	}
	now := time.Now()
	d := now.Sub(f.at)
	f.at = now
	if f.leaseLeft = f.leaseLeft - d; f.leaseLeft < 0 {
		f.leaseLeft = 0
	}
	if f.held >= 0 {
		f.held += d
	}
	return f
}

// newBusy is the error of a lock not taken (err: ErrNotObtained or
// ErrTooManyWaiters), with what is known of it as of now.
func newBusy(err error, f busyFacts, ahead int) *BusyError {
	return &BusyError{err: err, facts: f.aged(), ahead: ahead}
}

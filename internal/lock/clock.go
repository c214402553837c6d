package lock

// The clock of the engine's time-dependent logic.

import "time"

// Clock is where the engine reads the time for what it computes from it: a
// lease's validity (ttl − elapsed, − drift with Redlock), the keeper's
// schedule (every ttl/3, until max_hold) and a busy lock's hint of when it
// is free. Timers and the calls' timeouts run on real time. Engine tests
// move a fake one instead of sleeping.
type Clock interface {
	Now() time.Time
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (l *Locker) now() time.Time { return l.opts.Clock.Now() }

package lock

// The clock of the engine's time-dependent logic.

import "time"

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (l *Locker) now() time.Time { return l.opts.Clock.Now() }

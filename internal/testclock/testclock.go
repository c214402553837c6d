// Package testclock is the fake clock the engines' tests share: it moves
// only when a test moves it, so time-dependent logic (lease validity,
// backoff, the breaker's probes, the deny cache) is tested without a sleep.
package testclock

import (
	"sync"
	"time"
)

// Fake is a clock that moves only when Advance moves it. Its Now satisfies
// both engines' Clock interfaces.
type Fake struct {
	mu sync.Mutex
	t  time.Time
}

// New is a Fake at a fixed moment (2023-11-14 22:13:20 UTC).
func New() *Fake { return &Fake{t: time.Unix(1_700_000_000, 0)} }

// Now is the clock's time.
func (c *Fake) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock on by d.
func (c *Fake) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

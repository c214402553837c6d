package redisdlm

import (
	"sync"
	"time"
)

// denyCache remembers keys rejected until a moment, so they are answered
// without Redis until then. It holds at most max entries: when full, it
// drops expired entries (at most once a second), else an arbitrary one.
type denyCache struct {
	mu        sync.Mutex
	max       int
	m         map[string]denyEntry
	lastSweep time.Time
}

type denyEntry struct {
	until   time.Time // answer from memory before this (a little early)
	retryAt time.Time // Retry-After points here (a little late)
	tight   int       // the rate that rejects
	left    int64     // its remaining quota when Redis rejected (less than cost)
	cost    int64     // the rejected cost: only a request of this cost is answered here
}

func newDenyCache(max int) *denyCache {
	return &denyCache{max: max, m: make(map[string]denyEntry)}
}

// get returns the entry of id if it still rejects a request of cost. Only
// the same cost: a cheaper request may pass, and a costlier one passes
// later than retryAt, so both ask Redis.
func (c *denyCache) get(id string, now time.Time, cost int64) (denyEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	if !ok {
		return e, false
	}
	if !now.Before(e.until) {
		delete(c.m, id)
		return e, false
	}
	return e, cost == e.cost
}

func (c *denyCache) put(id string, e denyEntry, now time.Time) {
	if !now.Before(e.until) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[id]; !ok && len(c.m) >= c.max {
		if now.Sub(c.lastSweep) >= time.Second {
			c.lastSweep = now
			for k, v := range c.m {
				if !now.Before(v.until) {
					delete(c.m, k)
				}
			}
		}
		// Still full: drop some entry; it only costs a Redis call later.
		for k := range c.m {
			if len(c.m) < c.max {
				break
			}
			delete(c.m, k)
		}
	}
	c.m[id] = e
}

// drop forgets id (its quota was given back).
func (c *denyCache) drop(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, id)
}

func (c *denyCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

package ratelimit

import (
	"strings"
	"sync"
	"time"
)

// DenyCache remembers keys rejected until a moment, so they are answered
// without Redis until then. It holds at most max entries: when full, it
// drops expired entries (at most once a second), else an arbitrary one.
type DenyCache struct {
	clock     Clock
	mu        sync.Mutex
	max       int
	m         map[string]DenyEntry
	lastSweep time.Time
}

// newDenyCache makes a deny cache (NewDenyCache).
func newDenyCache(max int, clock Clock) *DenyCache {
	if clock == nil {
		clock = SystemClock{}
	}
	return &DenyCache{clock: clock, max: max, m: make(map[string]DenyEntry)}
}

// get returns the entry of id if it still rejects a request of cost. Only
// the same cost, unless it is a ban: a cheaper request may pass, and a
// costlier one passes later than RetryAt, so both ask Redis. A ban to be
// checked with Redis (Recheck) is not returned.
func (c *DenyCache) get(id string, cost int64) (DenyEntry, bool) {
	now := c.clock.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	if !ok {
		return e, false
	}
	if !now.Before(e.Until) {
		delete(c.m, id)
		return e, false
	}
	return e, !e.Recheck && (e.Banned || cost == e.Cost)
}

// put remembers a rejection of id until e.Until (nothing once it is past).
func (c *DenyCache) put(id string, e DenyEntry) {
	now := c.clock.Now()
	if !now.Before(e.Until) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[id]; !ok && len(c.m) >= c.max {
		c.makeRoom(now)
	}
	c.m[id] = e
}

// makeRoom drops expired entries (at most once a second), and then, if the
// cache is still full, some entry: it only costs a Redis call later.
func (c *DenyCache) makeRoom(now time.Time) {
	if now.Sub(c.lastSweep) >= time.Second {
		c.lastSweep = now
		for k, v := range c.m {
			if !now.Before(v.Until) {
				delete(c.m, k)
			}
		}
	}
	for k := range c.m {
		if len(c.m) < c.max {
			break
		}
		delete(c.m, k)
	}
}

// drop forgets id's rejection (its quota was given back); a ban stays.
func (c *DenyCache) drop(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.m[id].Banned {
		delete(c.m, id)
	}
}

// mark records id until until and reports whether it had no live entry:
// the cache as a set of keys that expire (one event per key per period),
// checked and set at once.
func (c *DenyCache) mark(id string, until time.Time) bool {
	now := c.clock.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.m[id]; ok && now.Before(e.Until) {
		return false
	}
	if !now.Before(until) {
		return true
	}
	if _, ok := c.m[id]; !ok && len(c.m) >= c.max {
		c.makeRoom(now)
	}
	c.m[id] = DenyEntry{Until: until, Banned: true}
	return true
}

// clear forgets every entry.
func (c *DenyCache) clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.m)
}

// len is the number of entries held.
func (c *DenyCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

// forget drops a key from the deny cache, under every plan, its ban too
// (an admin reset).
func (c *DenyCache) forget(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, id)
	for k := range c.m {
		if strings.HasPrefix(k, id+"\x00") {
			delete(c.m, k)
		}
	}
}

// announced remembers a ban another instance (or this one) announced: it
// ends in left and a request may pass in retry (later, when the quota that
// started it admits only then), both from now. A ban this cache holds from
// a Redis answer is kept (its moments are closer); a message arrives a
// little after it was sent, so the ban is held until a margin before left.
func (c *DenyCache) announced(id string, left, retry time.Duration) {
	now := c.clock.Now()
	e := DenyEntry{Until: now.Add(left - time.Millisecond - left/1000), RetryAt: now.Add(max(left, retry)), Banned: true}
	if !now.Before(e.Until) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old, ok := c.m[id]
	if ok && old.Banned && !old.Recheck && now.Before(old.Until) {
		return
	}
	if !ok && len(c.m) >= c.max {
		c.makeRoom(now)
	}
	c.m[id] = e
}

// KeepBans forgets every entry but the bans that have not ended (a reset
// may have been missed while the Pub/Sub connection was down; a ban is held
// until it ends). With recheck (a reconnect to the same Redis process, which
// may have lifted a ban meanwhile) every ban kept is marked to be checked
// with Redis. It returns the bans kept that are not to be checked, each
// under its key of limit l, for a new Redis process that lost them.
func (c *DenyCache) keepBans(recheck bool, l *Limit) []KeptBan {
	now := c.clock.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []KeptBan
	for id, e := range c.m {
		switch {
		case !e.Banned || !now.Before(e.Until):
			delete(c.m, id)
		case recheck:
			e.Recheck = true
			c.m[id] = e
		case !e.Recheck:
			out = append(out, KeptBan{Key: l.banKey(id), Left: e.Until.Sub(now), Retry: e.RetryAt.Sub(now)})
		}
	}
	return out
}

// kept returns id's ban if it is to be checked with Redis (Recheck) and has
// not ended: the answer while Redis cannot give one.
func (c *DenyCache) kept(id string) (DenyEntry, bool) {
	now := c.clock.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	return e, ok && e.Recheck && now.Before(e.Until)
}

// dropKept forgets id's ban if it is to be checked with Redis: Redis
// answered without it, so it was lifted meanwhile.
func (c *DenyCache) dropKept(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m[id].Recheck {
		delete(c.m, id)
	}
}

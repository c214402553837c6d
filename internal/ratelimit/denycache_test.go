package ratelimit

import (
	"testing"
	"time"
)

// TestDenyCacheKeepsBans: a resubscription forgets every rejection but the
// bans, which hold until they end; after one to the same Redis process
// they are no longer answered from memory (Get) but kept for when Redis
// cannot answer (Kept), until Redis answers without them (DropKept) or they
// end; after one to a new process they are answered as before and handed
// out for the write-back, with what is left of them. An announced ban is
// held a margin shorter than announced, and does not replace a ban the
// cache has from Redis.
func TestDenyCacheKeepsBans(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	now := clock.Now()
	c := NewDenyCache(100, clock)
	c.Put("plain", DenyEntry{Until: now.Add(5 * time.Second), Cost: 1})
	c.Put("ended", DenyEntry{Until: now.Add(time.Second), Banned: true})
	c.Put("mallory", DenyEntry{Until: now.Add(10 * time.Second), RetryAt: now.Add(12 * time.Second), Banned: true})
	c.Announced("carol", 20*time.Second, 20*time.Second)
	c.Announced("mallory", time.Hour, time.Hour) // held from Redis: kept as it is
	c.Announced("gone", 0, 0)                    // over: not held
	clock.Advance(2 * time.Second)

	lim := NewLimit("p", SlidingWindow, LimitOptions{})
	kept := c.KeepBans(false, lim)
	got := map[string]KeptBan{}
	for _, b := range kept {
		got[b.Key] = b
	}
	m, cr := got["p{mallory}:ban"], got["p{carol}:ban"]
	if len(kept) != 2 || m.Left != 8*time.Second || m.Retry != 10*time.Second ||
		cr.Left > 18*time.Second || cr.Left < 18*time.Second-30*time.Millisecond || cr.Retry != 18*time.Second {
		t.Fatalf("bans kept for a new process: %+v, want mallory (8s, Retry-After 10s) and carol (about 18s)", kept)
	}
	if _, ok := c.Get("plain", 1); ok || c.Len() != 2 {
		t.Fatalf("after a resubscription the cache holds %d entries, want the 2 bans only", c.Len())
	}
	if _, ok := c.Get("carol", 7); !ok {
		t.Fatal("a ban kept for a new process is not answered from memory")
	}

	if kept := c.KeepBans(true, lim); len(kept) != 0 {
		t.Fatalf("bans handed out after a reconnect to the same process: %+v, want none (they are checked)", kept)
	}
	if _, ok := c.Get("carol", 1); ok {
		t.Fatal("a ban to be checked with Redis is answered from memory")
	}
	if _, ok := c.Kept("carol"); !ok {
		t.Fatal("a ban to be checked with Redis is not kept for when Redis cannot answer")
	}
	if kept := c.KeepBans(false, lim); len(kept) != 0 {
		t.Fatalf("bans still to be checked were handed out for a write-back: %+v", kept)
	}
	c.DropKept("carol")
	if _, ok := c.Kept("carol"); ok {
		t.Fatal("a kept ban Redis answered without is still kept")
	}
	clock.Advance(9 * time.Second)
	if _, ok := c.Kept("mallory"); ok {
		t.Fatal("a kept ban is kept past its end")
	}
	c.Put("eve", DenyEntry{Until: clock.Now().Add(time.Second), Banned: true})
	c.DropKept("eve") // not to be checked: stays
	if _, ok := c.Get("eve", 1); !ok {
		t.Fatal("DropKept dropped a ban that was not to be checked")
	}
}

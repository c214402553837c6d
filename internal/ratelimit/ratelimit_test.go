package ratelimit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// nopObserver ignores the breaker's changes.
type nopObserver struct{}

func (nopObserver) BreakerOpened(int) {}
func (nopObserver) BreakerClosed()    {}

// TestRateLimitDenyCacheBounded: the cache never holds more than its cap and
// never answers past its entry's moment (on a fake clock: no sleep).
func TestRateLimitDenyCacheBounded(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	c := NewDenyCache(100, clock)
	now := clock.Now()
	for i := 0; i < 1000; i++ {
		c.Put(fmt.Sprint(i), DenyEntry{Until: now.Add(time.Duration(i%7+1) * time.Second)})
		if c.Len() > 100 {
			t.Fatalf("cache holds %d entries, cap 100", c.Len())
		}
	}
	c.Put("x", DenyEntry{Until: now.Add(time.Second), Cost: 1})
	clock.Advance(999 * time.Millisecond)
	if _, ok := c.Get("x", 1); !ok {
		t.Fatal("entry missing before its moment")
	}
	// Another cost asks Redis: a cheaper request may pass, a costlier one
	// passes later than the entry's Retry-After.
	for _, cost := range []int64{2, 0} {
		if _, ok := c.Get("x", cost); ok {
			t.Fatalf("an entry for cost 1 answered a request of cost %d", cost)
		}
	}
	clock.Advance(time.Millisecond)
	if _, ok := c.Get("x", 1); ok {
		t.Fatal("entry answered at its moment")
	}
	// A minute on, every entry is over: a Put into the full cache sweeps
	// them out.
	clock.Advance(time.Minute)
	for _, id := range []string{"y", "w"} {
		c.Put(id, DenyEntry{Until: clock.Now().Add(time.Second)})
	}
	if c.Len() > 2 {
		t.Fatalf("cache holds %d entries after all but 2 expired", c.Len())
	}
	c.Put("z", DenyEntry{Until: clock.Now()}) // already over: not stored
	if _, ok := c.Get("z", 0); ok || c.Len() > 2 {
		t.Fatal("expired entry stored")
	}
}

// TestRateLimitMultiPerSlot: on a Cluster, a pipeline's decisions are
// grouped per hash slot (keys of one decision share one).
func TestRateLimitMultiPerSlot(t *testing.T) {
	t.Parallel()
	calls := []*Call{}
	for _, id := range []string{"a", "b", "a", "c", "b", "a"} {
		calls = append(calls, &Call{script: slidingScript, keys: []string{"p:{" + id + "}:sw:1/1s", "p:{" + id + "}:sw:9/1h"}, argv: []any{1, 0, 1, 1000000, 9, 3600000000}})
	}
	calls = append(calls, &Call{script: slidingReturnScript, keys: []string{"p:{a}:sw:1/1s"}, argv: []any{1, 1, 1, 1}})
	count := func(us []*rlUnit) (multi, single int) {
		for _, u := range us {
			if u.batch {
				multi++
			} else {
				single++
			}
		}
		return
	}
	if m, s := count(units(calls, false)); m != 1 || s != 1 {
		t.Fatalf("one server: %d batches and %d single calls, want 1 and 1 (the return goes alone)", m, s)
	}
	us := units(calls, true)
	if m, s := count(us); m != 3 || s != 1 {
		t.Fatalf("cluster: %d batches and %d single calls, want 3 (slots of a, b and c) and 1 (the return)", m, s)
	}
	for _, u := range us {
		slot := keySlot(u.calls[0].keys[0])
		for _, c := range u.calls {
			for _, k := range c.keys {
				if keySlot(k) != slot {
					t.Fatalf("a batch mixes slots: %v", u.command(bySHA))
				}
			}
		}
	}
	// CRC16 as Redis Cluster computes it (CLUSTER KEYSLOT).
	for key, want := range map[string]int{"foo": 12182, "{user1000}.following": 3443, "p:{a}:x": 15495, "123456789": 12739} {
		if got := keySlot(key); got != want {
			t.Fatalf("keySlot(%q) = %d, want %d", key, got, want)
		}
	}
}

// TestBatcherCallsNeverResent: every command of the batcher, EVALSHA or
// EVAL, tells go-redis not to resend it after a transport error (a Cluster
// client otherwise resends a command whose answer was lost: a pipeline of
// decisions would run twice; see redisconn's script.go). The redirect and
// NOSCRIPT paths are exercised by the Cluster and restart tests.
func TestBatcherCallsNeverResent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var sent []redis.Cmder
	decision := &Call{script: gcraScript, keys: []string{"p:{a}:g"}, argv: []any{1, 0, 5, 1000000, 5}}
	giveBack := &Call{script: gcraReturnScript, keys: []string{"p:{a}:g"}, argv: []any{1, 5, 1000000, 5, 0, 0}}
	us := units([]*Call{decision, giveBack}, false)
	if len(us) != 2 {
		t.Fatalf("%d units, want 2", len(us))
	}
	for _, u := range us {
		for _, as := range []sendAs{bySHA, byText} {
			sent = append(sent, u.cmd(ctx, as))
		}
	}
	if len(sent) != 4 {
		t.Fatalf("%d commands, want 4", len(sent))
	}
	for _, c := range sent {
		if !c.NoRetry() {
			t.Fatalf("%v may be resent by go-redis", c.Args()[:3])
		}
	}
}

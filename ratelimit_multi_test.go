package redisdlm

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// sendBatch sends calls as one pipeline through b, as a worker would.
func sendBatch(b *rlBatcher, calls []*rlCall) {
	for _, c := range calls {
		c.args = c.command()
		c.deadline = time.Now().Add(5 * time.Second)
		c.done = make(chan struct{})
		c.state.Store(callTaken)
	}
	b.send(calls)
}

// TestRateLimitMultiDecisions: the decisions of one pipeline go to Redis as
// one script call per script (per hash slot on a Cluster); each is exact,
// as if sent alone and in order, and answered on its own; a decision that
// fails gets its own error and the others their answers.
func TestRateLimitMultiDecisions(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 7, Window: caddy.Duration(time.Minute)}, {Requests: 100, Window: caddy.Duration(time.Hour)}}
		})
		b := newBatcher(h.client.client, 0)
		defer b.close()
		if err := r.Client().RPush(context.Background(), h.keyHead+"bad"+h.static.rates[0].tail, "x").Err(); err != nil {
			t.Fatal(err)
		}
		var calls []*rlCall
		ids := []string{}
		for i := 0; i < 30; i++ {
			ids = append(ids, "hot")
			if i%3 == 0 {
				ids = append(ids, fmt.Sprintf("cold%d", i))
			}
		}
		ids = append(ids, "bad")
		for _, id := range ids {
			calls = append(calls, &rlCall{script: h.script, argv: h.static.argv, keys: h.redisKeys(nil, id, &h.static)})
		}
		sendBatch(b, calls) // loads the multi script (NOSCRIPT, then EVAL)
		for _, c := range calls {
			<-c.done
		}
		r.Client().Del(context.Background(), r.Client().Keys(context.Background(), h.keyHead+"hot*").Val()...)
		r.Client().Del(context.Background(), r.Client().Keys(context.Background(), h.keyHead+"cold*").Val()...)
		for _, c := range calls {
			c.res, c.err = nil, nil
			c.state.Store(callPending)
		}
		before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		sendBatch(b, calls)
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 1 {
			t.Fatalf("%d decisions in one pipeline made %d script calls, want 1", len(calls), got)
		}
		hot := 0
		for i, c := range calls {
			<-c.done
			if ids[i] == "bad" {
				if c.err == nil || !strings.Contains(c.err.Error(), "WRONGTYPE") && !strings.Contains(strings.ToLower(c.err.Error()), "script") {
					t.Fatalf("decision on a key of the wrong type: %v %v, want its own error", c.res, c.err)
				}
				continue
			}
			if c.err != nil {
				t.Fatalf("decision %d (%s): %v", i, ids[i], c.err)
			}
			d, err := parseDecision(c.res, 2)
			if err != nil {
				t.Fatal(err)
			}
			switch ids[i] {
			case "hot":
				if d.allowed {
					hot++
					if d.remaining != int64(7-hot) {
						t.Fatalf("hot admission %d: remaining %d, want %d", hot, d.remaining, 7-hot)
					}
				} else if d.wait < 5*time.Second {
					t.Fatalf("hot rejection waits %s, want until a slot frees (gcra: 1/7 min, sliding: a minute)", d.wait)
				}
			default:
				if !d.allowed || d.remaining != 6 {
					t.Fatalf("%s: allowed=%v remaining %d, want admitted with 6 left", ids[i], d.allowed, d.remaining)
				}
			}
		}
		if hot != 7 {
			t.Fatalf("hot key: %d of 30 admitted in one multi call, want exactly 7", hot)
		}
	})
}

// TestRateLimitMultiPerSlot: on a Cluster, a pipeline's decisions are
// grouped per hash slot (keys of one decision share one).
func TestRateLimitMultiPerSlot(t *testing.T) {
	t.Parallel()
	calls := []*rlCall{}
	for _, id := range []string{"a", "b", "a", "c", "b", "a"} {
		calls = append(calls, &rlCall{script: slidingScript, keys: []string{"p:{" + id + "}:sw:1/1s", "p:{" + id + "}:sw:9/1h"}, argv: []any{1, 0, 1, 1000000, 9, 3600000000}})
	}
	calls = append(calls, &rlCall{script: slidingReturnScript, keys: []string{"p:{a}:sw:1/1s"}, argv: []any{1, 1, 1, 1}})
	for _, c := range calls {
		c.args = c.command()
	}
	count := func(us []*rlUnit) (multi, single int) {
		for _, u := range us {
			if u.script != nil {
				multi++
			} else {
				single++
			}
		}
		return
	}
	if m, s := count(units(calls, false)); m != 1 || s != 1 {
		t.Fatalf("one server: %d multi and %d single calls, want 1 and 1 (the return goes alone)", m, s)
	}
	us := units(calls, true)
	if m, s := count(us); m != 2 || s != 2 {
		t.Fatalf("cluster: %d multi and %d single calls, want 2 (slots of a and b) and 2 (c alone in its slot, the return)", m, s)
	}
	for _, u := range us {
		slot := keySlot(u.calls[0].keys[0])
		for _, k := range u.keys {
			if keySlot(k) != slot {
				t.Fatalf("multi call mixes slots: %v", u.keys)
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

package redisdlm

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// sendBatch sends calls as one pipeline through b, as a worker would.
func sendBatch(b *rlBatcher, calls []*rlCall) {
	for _, c := range calls {
		c.deadline = time.Now().Add(5 * time.Second)
		c.done = make(chan struct{})
		c.finished = false
		c.state.Store(callTaken)
	}
	b.send(calls)
}

// TestRateLimitMultiDecisions: the decisions of one pipeline go to Redis as
// one script call per script (per hash slot on a Cluster), also when they
// come from different limits; each is exact, as if sent alone and in order,
// and answered on its own; a decision whose key cannot be read gets its own
// error (sent again alone) and the others their answers.
func TestRateLimitMultiDecisions(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 7, Window: caddy.Duration(time.Minute)}, {Requests: 100, Window: caddy.Duration(time.Hour)}}
		})
		// Another limit on the same Redis: one rate, its own parameters.
		h2 := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(time.Minute)}}
			h.Prefix = "other:"
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
			if i%2 == 0 {
				ids = append(ids, "other")
			}
		}
		ids = append(ids, "bad")
		for _, id := range ids {
			if id == "other" {
				calls = append(calls, &rlCall{script: h2.script, argv: h2.static.argv, keys: h2.redisKeys(nil, "hot", &h2.static)})
				continue
			}
			calls = append(calls, &rlCall{script: h.script, argv: h.static.argv, keys: h.redisKeys(nil, id, &h.static)})
		}
		sendBatch(b, calls) // loads the script (NOSCRIPT, then EVAL)
		for _, c := range calls {
			<-c.done
		}
		for _, p := range []string{h.keyHead + "hot*", h.keyHead + "cold*", h2.keyHead + "*"} {
			r.Client().Del(context.Background(), r.Client().Keys(context.Background(), p).Val()...)
		}
		for _, c := range calls {
			c.res, c.err = nil, nil
			c.state.Store(callPending)
		}
		before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		sendBatch(b, calls)
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 2 {
			t.Fatalf("%d decisions in one pipeline made %d script calls, want 2 (the batch, then the unreadable one alone)", len(calls), got)
		}
		hot, other := 0, 0
		for i, c := range calls {
			<-c.done
			if ids[i] == "bad" {
				if c.err == nil || !strings.Contains(c.err.Error(), "WRONGTYPE") {
					t.Fatalf("decision on a key of the wrong type: %v %v, want its own WRONGTYPE error", c.res, c.err)
				}
				continue
			}
			if c.err != nil {
				t.Fatalf("decision %d (%s): %v", i, ids[i], c.err)
			}
			if ids[i] == "other" {
				d, err := parseDecision(c.res, 1, decisionScripts[c.script])
				if err != nil {
					t.Fatal(err)
				}
				if d.allowed {
					other++
					if d.remaining != int64(3-other) {
						t.Fatalf("other limit, admission %d: remaining %d, want %d", other, d.remaining, 3-other)
					}
				}
				continue
			}
			d, err := parseDecision(c.res, 2, decisionScripts[c.script])
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
		if hot != 7 || other != 3 {
			t.Fatalf("hot key: %d of 30 admitted by 7/min and %d of 15 by the other limit's 3/min, in one batch; want 7 and 3", hot, other)
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
					t.Fatalf("a batch mixes slots: %v", u.command(false))
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

// decideOnce runs one decision through a decision script as a batch of one,
// as the batcher sends it: argv is the decision's parameter set (cost,
// hold, then every rate's n, window and, for gcra, burst). p is a client or a
// pipeline (then the answer is read after Exec, and the script must be
// loaded already).
func decideOnce(ctx context.Context, p interface {
	Process(context.Context, redis.Cmder) error
}, script *luaScript, keys []string, argv ...any) *redis.IntSliceCmd {
	u := &rlUnit{calls: []*rlCall{{script: script, keys: keys, argv: argv}}, batch: true}
	cmd := redis.NewIntSliceCmd(ctx, u.command(false)...)
	_ = p.Process(ctx, cmd)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = redis.NewIntSliceCmd(ctx, u.command(true)...)
		_ = p.Process(ctx, cmd)
	}
	return cmd
}

// TestRateLimitMultiFailures: in a batch, a decision that fails is answered
// on its own and the others still run. One that failed before writing (a
// value that is not the script's state) is sent again alone and gets
// Redis's own error; one that failed while writing (Redis out of memory) is
// not sent again, so nothing is counted twice.
func TestRateLimitMultiFailures(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		ctx := context.Background()
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
		})
		b := newBatcher(h.client.client, 0)
		defer b.close()
		call := func(id string) *rlCall {
			return &rlCall{script: h.script, argv: h.static.argv, keys: h.redisKeys(nil, id, &h.static)}
		}
		warm := []*rlCall{call("warm")}
		sendBatch(b, warm) // loads the script (NOSCRIPT, then EVAL)
		<-warm[0].done
		if algo == algoGCRA {
			// A string that is not a TAT: the script fails on it.
			if err := r.Client().Set(ctx, h.keyHead+"junk"+h.static.rates[0].tail, "not-a-number", time.Hour).Err(); err != nil {
				t.Fatal(err)
			}
			calls := []*rlCall{call("a"), call("junk"), call("b")}
			before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
			sendBatch(b, calls)
			for i, c := range calls {
				<-c.done
				if i == 1 {
					if c.err == nil || !strings.Contains(c.err.Error(), "compare") {
						t.Fatalf("decision on a value that is not a TAT: %v %v, want Redis's own script error", c.res, c.err)
					}
					continue
				}
				if d, err := parseDecision(c.res, 1, decisionScripts[c.script]); c.err != nil || err != nil || !d.allowed || d.remaining != 9 {
					t.Fatalf("decision %d beside a failing one: %+v %v %v, want admitted with 9 left", i, d, c.err, err)
				}
			}
			if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 2 {
				t.Fatalf("%d script calls, want 2 (the batch, then the failed decision alone)", got)
			}
		}

		// Out of memory: every write fails; reads still work.
		if err := r.Client().ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
			t.Fatal(err)
		}
		defer r.Client().ConfigSet(ctx, "maxmemory", "0")
		calls := []*rlCall{call("m1"), call("m2"), call("m3")}
		before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		sendBatch(b, calls)
		for i, c := range calls {
			<-c.done
			if !errors.Is(c.err, errFailedRun) {
				t.Fatalf("decision %d while Redis refuses writes: %v %v, want errFailedRun", i, c.res, c.err)
			}
		}
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 1 {
			t.Fatalf("%d script calls, want 1 (a decision that may have written is not sent again)", got)
		}
		one := []*rlCall{call("m4")}
		sendBatch(b, one)
		<-one[0].done
		if one[0].err == nil || !strings.Contains(one[0].err.Error(), "OOM") {
			t.Fatalf("a decision alone while Redis refuses writes: %v, want Redis's OOM error", one[0].err)
		}
	})
}

// TestScriptCallsNeverResent: every script call, of the lock engine and of
// the rate limiter's batcher, tells go-redis not to resend it after a
// transport error (a Cluster client otherwise resends a command whose answer
// was lost: a lock script or a pipeline of decisions would run twice; see
// script.go). The redirect and NOSCRIPT paths are exercised by the Cluster
// and restart tests.
func TestScriptCallsNeverResent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var sent []redis.Cmder
	capture := processorFunc(func(_ context.Context, c redis.Cmder) error {
		sent = append(sent, c)
		return nil
	})
	acquireScript.Run(ctx, capture, []string{"k"}, "token")
	acquireScript.Eval(ctx, capture, []string{"k"}, "token")
	decision := &rlCall{script: gcraScript, keys: []string{"p:{a}:g"}, argv: []any{1, 0, 5, 1000000, 5}}
	giveBack := &rlCall{script: gcraReturnScript, keys: []string{"p:{a}:g"}, argv: []any{1, 5, 1000000, 5, 0, 0}}
	us := units([]*rlCall{decision, giveBack}, false)
	if len(us) != 2 {
		t.Fatalf("%d units, want 2", len(us))
	}
	for _, u := range us {
		for _, eval := range []bool{false, true} {
			sent = append(sent, u.cmd(ctx, eval))
		}
	}
	if len(sent) != 6 {
		t.Fatalf("%d commands, want 6", len(sent))
	}
	for _, c := range sent {
		if !c.NoRetry() {
			t.Fatalf("%v may be resent by go-redis", c.Args()[:3])
		}
	}
}

type processorFunc func(context.Context, redis.Cmder) error

func (f processorFunc) Process(ctx context.Context, c redis.Cmder) error { return f(ctx, c) }

// TestRejectionNamesARejectingRate: the RateLimit field of a rejected
// request names a rate that rejects it. r0 (10 per 1s, none left, grows in
// 0.1s) would admit within the hold of 0.5s; r1 (6 per 1h, 2 left) rejects
// a request of cost 3 for about 10 minutes. Once a rejecting rate reported
// its real remaining quota, the "least remaining" choice named r0.
func TestRejectionNamesARejectingRate(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	ctx := context.Background()
	c := r.Client()
	now := c.Time(ctx).Val().UnixMicro()
	k0, k1 := "rl:{x}:r0", "rl:{x}:r1"
	c.Set(ctx, k0, fmt.Sprint(now+1_000_000), time.Hour)
	c.Set(ctx, k1, fmt.Sprint(now+2_400_000_000), time.Hour)
	res, err := decideOnce(ctx, c, gcraScript, []string{k0, k1}, 3, 500000, 10, 1_000_000, 10, 6, 3_600_000_000, 6).Result()
	if err != nil {
		t.Fatal(err)
	}
	d, err := parseDecision(res, 2, decisionScripts[gcraScript])
	if err != nil {
		t.Fatal(err)
	}
	if d.allowed || d.tight != 1 || d.remaining != 2 || d.reset < 9*time.Minute {
		t.Fatalf("answer %v: allowed=%v tight=r%d remaining %d reset %v, want rejected by r1 with 2 left for about 10 minutes", res, d.allowed, d.tight, d.remaining, d.reset)
	}
}

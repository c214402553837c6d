package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestRateLimitMultiDecisions: the decisions of one pipeline go to Redis as
// one script call per script (per hash slot on a Cluster), also when they
// come from different limits; each is exact, as if sent alone and in order,
// and answered on its own; a decision whose key cannot be read gets its own
// error (sent again alone) and the others their answers.
func TestRateLimitMultiDecisions(t *testing.T) {
	t.Parallel()
	eachAlgorithm(t, func(t *testing.T, algo Algorithm, r *testredis.Server) {
		// Returns: full answers, as a limit with count or wait gets.
		h := NewLimit("caddy:rl:", algo, LimitOptions{Returns: true})
		p := h.Plan([]Rate{{N: 7, Window: time.Minute}, {N: 100, Window: time.Hour}}, 1)
		// Another limit on the same Redis: one rate, its own parameters.
		h2 := NewLimit("other:", algo, LimitOptions{Returns: true})
		p2 := h2.Plan([]Rate{{N: 3, Window: time.Minute}}, 1)
		b := NewBatcher(r.Client(), Options{})
		defer b.Close()
		if err := r.Client().RPush(context.Background(), h.keys(nil, "bad", p)[0], "x").Err(); err != nil {
			t.Fatal(err)
		}
		var calls []*Call
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
				calls = append(calls, h2.DecisionCall("hot", p2))
				continue
			}
			calls = append(calls, h.DecisionCall(id, p))
		}
		b.SendNow(calls) // loads the script (NOSCRIPT, then EVAL)
		for _, c := range calls {
			<-c.Done()
		}
		for _, k := range []string{h.head + "hot*", h.head + "cold*", h2.head + "*"} {
			r.Client().Del(context.Background(), r.Client().Keys(context.Background(), k).Val()...)
		}
		for _, c := range calls {
			c.res, c.err = nil, nil
		}
		before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		b.SendNow(calls)
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 2 {
			t.Fatalf("%d decisions in one pipeline made %d script calls, want 2 (the batch, then the unreadable one alone)", len(calls), got)
		}
		hot, other := 0, 0
		for i, c := range calls {
			<-c.Done()
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
				if d.Allowed {
					other++
					if d.Remaining != int64(3-other) {
						t.Fatalf("other limit, admission %d: remaining %d, want %d", other, d.Remaining, 3-other)
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
				if d.Allowed {
					hot++
					if d.Remaining != int64(7-hot) {
						t.Fatalf("hot admission %d: remaining %d, want %d", hot, d.Remaining, 7-hot)
					}
				} else if d.Wait < 5*time.Second {
					t.Fatalf("hot rejection waits %s, want until a slot frees (gcra: 1/7 min, sliding: a minute)", d.Wait)
				}
			default:
				if !d.Allowed || d.Remaining != 6 {
					t.Fatalf("%s: allowed=%v remaining %d, want admitted with 6 left", ids[i], d.Allowed, d.Remaining)
				}
			}
		}
		if hot != 7 || other != 3 {
			t.Fatalf("hot key: %d of 30 admitted by 7/min and %d of 15 by the other limit's 3/min, in one batch; want 7 and 3", hot, other)
		}
	})
}

// decideOnce runs one decision through a decision script as a batch of one,
// as the batcher sends it: argv is the decision's parameter set (cost,
// hold, then every rate's n, window and, for gcra, burst). p is a client or a
// pipeline (then the answer is read after Exec, and the script must be
// loaded already).
func decideOnce(ctx context.Context, p interface {
	Process(context.Context, redis.Cmder) error
}, script *redisconn.Script, keys []string, argv ...any) *redis.IntSliceCmd {
	evalsha, eval := batchOfOne(&Call{script: script, keys: keys, argv: argv})
	cmd := redis.NewIntSliceCmd(ctx, evalsha...)
	_ = p.Process(ctx, cmd)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = redis.NewIntSliceCmd(ctx, eval...)
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
	eachAlgorithm(t, func(t *testing.T, algo Algorithm, r *testredis.Server) {
		ctx := context.Background()
		h := NewLimit("caddy:rl:", algo, LimitOptions{Returns: true})
		p := h.Plan([]Rate{{N: 10, Window: time.Minute}}, 1)
		b := NewBatcher(r.Client(), Options{})
		defer b.Close()
		call := func(id string) *Call { return h.DecisionCall(id, p) }
		warm := []*Call{call("warm")}
		b.SendNow(warm) // loads the script (NOSCRIPT, then EVAL)
		<-warm[0].Done()
		if algo == GCRA {
			// A string that is not a TAT: the script fails on it.
			if err := r.Client().Set(ctx, h.keys(nil, "junk", p)[0], "not-a-number", time.Hour).Err(); err != nil {
				t.Fatal(err)
			}
			calls := []*Call{call("a"), call("junk"), call("b")}
			before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
			b.SendNow(calls)
			for i, c := range calls {
				<-c.Done()
				if i == 1 {
					if c.err == nil || !strings.Contains(c.err.Error(), "compare") {
						t.Fatalf("decision on a value that is not a TAT: %v %v, want Redis's own script error", c.res, c.err)
					}
					continue
				}
				if d, err := parseDecision(c.res, 1, decisionScripts[c.script]); c.err != nil || err != nil || !d.Allowed || d.Remaining != 9 {
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
		calls := []*Call{call("m1"), call("m2"), call("m3")}
		before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		b.SendNow(calls)
		for i, c := range calls {
			<-c.Done()
			if !errors.Is(c.err, ErrFailedRun) {
				t.Fatalf("decision %d while Redis refuses writes: %v %v, want ErrFailedRun", i, c.res, c.err)
			}
		}
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 1 {
			t.Fatalf("%d script calls, want 1 (a decision that may have written is not sent again)", got)
		}
		one := []*Call{call("m4")}
		b.SendNow(one)
		<-one[0].Done()
		if one[0].err == nil || !strings.Contains(one[0].err.Error(), "OOM") {
			t.Fatalf("a decision alone while Redis refuses writes: %v, want Redis's OOM error", one[0].err)
		}
	})
}

// TestRejectionNamesARejectingRate: the RateLimit field of a rejected
// request names a rate that rejects it. r0 (10 per 1s, none left, grows in
// 0.1s) would admit within the hold of 0.5s; r1 (6 per 1h, 2 left) rejects
// a request of cost 3 for about 10 minutes. Once a rejecting rate reported
// its real remaining quota, the "least remaining" choice named r0.
func TestRejectionNamesARejectingRate(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	ctx := context.Background()
	c := r.Client()
	now := c.Time(ctx).Val().UnixMicro()
	k0, k1 := "rl:{x}:r0", "rl:{x}:r1"
	c.Set(ctx, k0, fmt.Sprint(now+1_000_000), time.Hour)
	c.Set(ctx, k1, fmt.Sprint(now+2_400_000_000), time.Hour)
	res, err := decideOnce(ctx, c, gcraScript, []string{k0, k1}, 3, 500000, 0, 10, 1_000_000, 10, 6, 3_600_000_000, 6).Result()
	if err != nil {
		t.Fatal(err)
	}
	d, err := parseDecision(res, 2, decisionScripts[gcraScript])
	if err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.Tight != 1 || d.Remaining != 2 || d.Reset < 9*time.Minute {
		t.Fatalf("answer %v: allowed=%v tight=r%d remaining %d reset %v, want rejected by r1 with 2 left for about 10 minutes", res, d.Allowed, d.Tight, d.Remaining, d.Reset)
	}
}

// eachAlgorithm runs f for every algorithm, each on a Redis of its own, as
// parallel subtests.
func eachAlgorithm(t *testing.T, f func(t *testing.T, algo Algorithm, r *testredis.Server)) {
	t.Helper()
	for _, algo := range Algorithms() {
		t.Run(algo.Name(), func(t *testing.T) {
			t.Parallel()
			f(t, algo, testredis.Start(t))
		})
	}
}

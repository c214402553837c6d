package redisratelimit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

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
		b := ratelimit.NewBatcher(h.client.Redis, ratelimit.Options{})
		defer b.Close()
		if err := r.Client().RPush(context.Background(), h.keyHead+"bad"+h.static.rates[0].tail, "x").Err(); err != nil {
			t.Fatal(err)
		}
		var calls []*ratelimit.Call
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
				calls = append(calls, &ratelimit.Call{Script: h2.script, Argv: h2.static.argv, Keys: h2.redisKeys(nil, "hot", &h2.static)})
				continue
			}
			calls = append(calls, &ratelimit.Call{Script: h.script, Argv: h.static.argv, Keys: h.redisKeys(nil, id, &h.static)})
		}
		b.SendNow(calls) // loads the script (NOSCRIPT, then EVAL)
		for _, c := range calls {
			<-c.Done()
		}
		for _, p := range []string{h.keyHead + "hot*", h.keyHead + "cold*", h2.keyHead + "*"} {
			r.Client().Del(context.Background(), r.Client().Keys(context.Background(), p).Val()...)
		}
		for _, c := range calls {
			c.Res, c.Err = nil, nil
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
				if c.Err == nil || !strings.Contains(c.Err.Error(), "WRONGTYPE") {
					t.Fatalf("decision on a key of the wrong type: %v %v, want its own WRONGTYPE error", c.Res, c.Err)
				}
				continue
			}
			if c.Err != nil {
				t.Fatalf("decision %d (%s): %v", i, ids[i], c.Err)
			}
			if ids[i] == "other" {
				d, err := ratelimit.ParseDecision(c.Res, 1, ratelimit.PerRate(c.Script))
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
			d, err := ratelimit.ParseDecision(c.Res, 2, ratelimit.PerRate(c.Script))
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
	evalsha, eval := ratelimit.BatchOfOne(&ratelimit.Call{Script: script, Keys: keys, Argv: argv})
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
	eachAlgorithm(t, func(t *testing.T, algo string, r *testRedis, newRL func(func(*RedisRateLimit)) *RedisRateLimit) {
		ctx := context.Background()
		h := newRL(func(h *RedisRateLimit) {
			h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
		})
		b := ratelimit.NewBatcher(h.client.Redis, ratelimit.Options{})
		defer b.Close()
		call := func(id string) *ratelimit.Call {
			return &ratelimit.Call{Script: h.script, Argv: h.static.argv, Keys: h.redisKeys(nil, id, &h.static)}
		}
		warm := []*ratelimit.Call{call("warm")}
		b.SendNow(warm) // loads the script (NOSCRIPT, then EVAL)
		<-warm[0].Done()
		if algo == algoGCRA {
			// A string that is not a TAT: the script fails on it.
			if err := r.Client().Set(ctx, h.keyHead+"junk"+h.static.rates[0].tail, "not-a-number", time.Hour).Err(); err != nil {
				t.Fatal(err)
			}
			calls := []*ratelimit.Call{call("a"), call("junk"), call("b")}
			before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
			b.SendNow(calls)
			for i, c := range calls {
				<-c.Done()
				if i == 1 {
					if c.Err == nil || !strings.Contains(c.Err.Error(), "compare") {
						t.Fatalf("decision on a value that is not a TAT: %v %v, want Redis's own script error", c.Res, c.Err)
					}
					continue
				}
				if d, err := ratelimit.ParseDecision(c.Res, 1, ratelimit.PerRate(c.Script)); c.Err != nil || err != nil || !d.Allowed || d.Remaining != 9 {
					t.Fatalf("decision %d beside a failing one: %+v %v %v, want admitted with 9 left", i, d, c.Err, err)
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
		calls := []*ratelimit.Call{call("m1"), call("m2"), call("m3")}
		before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
		b.SendNow(calls)
		for i, c := range calls {
			<-c.Done()
			if !errors.Is(c.Err, ratelimit.ErrFailedRun) {
				t.Fatalf("decision %d while Redis refuses writes: %v %v, want ratelimit.ErrFailedRun", i, c.Res, c.Err)
			}
		}
		if got := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before; got != 1 {
			t.Fatalf("%d script calls, want 1 (a decision that may have written is not sent again)", got)
		}
		one := []*ratelimit.Call{call("m4")}
		b.SendNow(one)
		<-one[0].Done()
		if one[0].Err == nil || !strings.Contains(one[0].Err.Error(), "OOM") {
			t.Fatalf("a decision alone while Redis refuses writes: %v, want Redis's OOM error", one[0].Err)
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
	r := startRedis(t)
	ctx := context.Background()
	c := r.Client()
	now := c.Time(ctx).Val().UnixMicro()
	k0, k1 := "rl:{x}:r0", "rl:{x}:r1"
	c.Set(ctx, k0, fmt.Sprint(now+1_000_000), time.Hour)
	c.Set(ctx, k1, fmt.Sprint(now+2_400_000_000), time.Hour)
	res, err := decideOnce(ctx, c, ratelimit.GCRAScript, []string{k0, k1}, 3, 500000, 0, 10, 1_000_000, 10, 6, 3_600_000_000, 6).Result()
	if err != nil {
		t.Fatal(err)
	}
	d, err := ratelimit.ParseDecision(res, 2, ratelimit.PerRate(ratelimit.GCRAScript))
	if err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.Tight != 1 || d.Remaining != 2 || d.Reset < 9*time.Minute {
		t.Fatalf("answer %v: allowed=%v tight=r%d remaining %d reset %v, want rejected by r1 with 2 left for about 10 minutes", res, d.Allowed, d.Tight, d.Remaining, d.Reset)
	}
}

package ratelimit

import (
	"context"
	"fmt"
	"math/rand"
	"slices"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// timeLine is the decision scripts' one TIME call; the test below puts a
// clock of its own there, so that two scripts decide at the same moment.
const timeLine = "local t = redis.call('TIME')"

// atClock is script src deciding at Redis time us (µs) instead of TIME.
func atClock(t *testing.T, src string, us int64) string {
	t.Helper()
	if !strings.Contains(src, timeLine) {
		t.Fatal("a decision script without its TIME line")
	}
	return strings.Replace(src, timeLine, fmt.Sprintf("local t = {'%d', '%d'}", us/1000000, us%1000000), 1)
}

// TestRateLimitFastPathSameAnswers: the fast path of a decision (one rate,
// no ban, no index, a key without returns: decide1) answers and writes
// exactly what the general path (decide) does. The same random sequence of
// decisions, at the same moments, goes through the script as it is (keys
// "f:...") and through one without its fast path (keys "g:..."); every
// answer, every value written and every expiry must be equal. The sequence
// holds batches and calls alone, one and several parameter sets, sets of
// two rates and of one, held and rejected requests, keys with returns and
// a key that holds no TAT. The same decisions with lean answers (a set
// whose admissions are never returned) answer the same without the
// integers past the first two of each rate, and write the same.
func TestRateLimitFastPathSameAnswers(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := r.Client()
	ctx := context.Background()
	for _, tc := range []struct {
		name     string
		body     string
		per      int
		script   *redisconn.Script
		giveBack string
		// rate is one rate's arguments (n, w in µs[, burst]) and its
		// capacity (what a cost may be at most).
		rate func(rng *rand.Rand) (args []int64, capacity int64)
		// ret is the return script's arguments for an admission of one
		// rate: of its call's argv, and its answer.
		ret func(argv []any, res []int64) []any
	}{
		{
			name: "gcra", body: gcraStepLua + gcraLua, per: perGCRA, script: gcraScript, giveBack: gcraReturnLua,
			rate: func(rng *rand.Rand) ([]int64, int64) {
				n := []int64{1, 3, 10, 1000000}[rng.Intn(4)]
				w := []int64{1000000, 10000000, 60000000, 7000001}[rng.Intn(4)]
				burst := 1 + rng.Int63n(n)
				return []int64{n, w, burst}, burst
			},
			ret: func(a []any, res []int64) []any { return []any{a[0], a[3], a[4], a[5], res[4], res[5]} },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fast := decisionScript(tc.body, tc.per)
			general := decisionScript(tc.body+"\ndecide1 = nil\n", tc.per)
			if fast == general {
				t.Fatal("the scripts do not differ")
			}
			rng := rand.New(rand.NewSource(int64(len(tc.name)) * 7919))
			type paramSet struct {
				rates      []int64 // every rate's arguments
				nrates     int
				cost, hold int64
			}
			var sets []paramSet
			for i := 0; i < 7; i++ {
				nr := 1
				if i == 6 {
					nr = 2 // a set of two rates: the general path on both sides
				}
				ps := paramSet{nrates: nr, cost: 1, hold: []int64{0, 0, 500000, 3000000}[rng.Intn(4)]}
				capacity := int64(1 << 62)
				for j := 0; j < nr; j++ {
					args, c := tc.rate(rng)
					ps.rates = append(ps.rates, args...)
					capacity = min(capacity, c)
				}
				if i%2 == 1 {
					ps.cost = 1 + rng.Int63n(min(capacity, 3))
				}
				sets = append(sets, ps)
			}
			ids := []string{"a", "b", "c"}
			// Redis's own time: what the scripts write expires by it.
			now, err := c.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			clock := now.UnixMicro()
			keysOf := func(prefix, id string, nrates int) []string {
				var ks []string
				for j := 0; j < nrates; j++ {
					ks = append(ks, fmt.Sprintf("%s%s:%d", prefix, id, j))
				}
				return ks
			}
			for _, p := range []string{"f:", "g:", "l:"} {
				// A value that is not the script's state.
				c.Set(ctx, p+"junk:0", "not-a-tat", 0)
			}
			run := func(prefix, src string, calls []*Call) ([]int64, error) {
				u := &rlUnit{calls: calls, batch: true}
				args := u.command(byText)
				args[1] = src
				return c.Do(ctx, args...).Int64Slice()
			}
			seen := map[string]int{}
			for step := 0; step < 400; step++ {
				clock += []int64{0, 1, 1, 700, 50000, 400000, 2000000}[rng.Intn(7)]
				n := 1
				if rng.Intn(3) > 0 {
					n = 2 + rng.Intn(6)
				}
				var fc, gc, lc []*Call // fast path, general path, lean answers
				oneSet := rng.Intn(2) == 0
				s0 := rng.Intn(len(sets))
				for i := 0; i < n; i++ {
					si := s0
					if !oneSet {
						si = rng.Intn(len(sets))
					}
					s := sets[si]
					argv := []any{s.cost, s.hold, 0}
					for _, x := range s.rates {
						argv = append(argv, x)
					}
					id := ids[rng.Intn(len(ids))]
					if s.nrates == 1 && rng.Intn(20) == 0 {
						id = "junk"
					}
					fc = append(fc, &Call{script: tc.script, keys: keysOf("f:", id, s.nrates), argv: argv})
					gc = append(gc, &Call{script: tc.script, keys: keysOf("g:", id, s.nrates), argv: argv})
					lc = append(lc, &Call{script: tc.script, keys: keysOf("l:", id, s.nrates), argv: argv, lean: true})
				}
				fres, ferr := run("f:", atClock(t, fast, clock), fc)
				gres, gerr := run("g:", atClock(t, general, clock), gc)
				if (ferr != nil) != (gerr != nil) || !slices.Equal(fres, gres) {
					t.Fatalf("step %d (%d decisions): fast path %v %v, general path %v %v", step, n, fres, ferr, gres, gerr)
				}
				lres, lerr := run("l:", atClock(t, fast, clock), lc)
				if (ferr != nil) != (lerr != nil) {
					t.Fatalf("step %d: lean answers %v %v, full ones %v %v", step, lres, lerr, fres, ferr)
				}
				if ferr == nil {
					// A lean answer is the full one without the integers
					// past the first two of each rate.
					if u := (&rlUnit{calls: lc, batch: true}); !u.answer(lres) {
						t.Fatalf("step %d: lean answers %v: not of their length", step, lres)
					}
					(&rlUnit{calls: fc, batch: true}).answer(fres)
					for i, c := range fc {
						want := append([]int64(nil), c.res[:2]...)
						for r := 0; r < len(c.keys); r++ {
							want = append(want, c.res[2+tc.per*r:4+tc.per*r]...)
						}
						if !slices.Equal(lc[i].res, want) {
							t.Fatalf("step %d, decision %d: lean answer %v, full one %v", step, i, lc[i].res, c.res)
						}
					}
				}
				if u := (&rlUnit{calls: fc, batch: true}); ferr == nil && u.answer(fres) {
					for _, c := range fc {
						switch {
						case c.res[0] == failedRead:
							seen["failed"]++
						case c.res[0] < 0:
							seen["rejected"]++
						case c.res[0] > 1:
							seen["held"]++
						default:
							seen["admitted"]++
						}
					}
				}
				if ferr == nil && step%5 == 0 {
					// Return an admission now and then (a key with returns
					// then takes the general path on both sides).
					u := &rlUnit{calls: fc, batch: true}
					if u.answer(fres) && fres[0] >= 0 && len(fc[0].keys) == 1 && !strings.Contains(fc[0].keys[0], "junk") {
						ret := tc.giveBack
						if strings.Contains(ret, timeLine) {
							ret = atClock(t, ret, clock)
						}
						for _, p := range []string{"f:", "g:", "l:"} {
							key := strings.Replace(fc[0].keys[0], "f:", p, 1)
							err := c.Eval(ctx, ret, []string{key}, tc.ret(fc[0].argv, fc[0].res)...).Err()
							if err != nil && err != redis.Nil {
								t.Fatalf("returning an admission: %v", err)
							}
						}
					}
				}
				for _, id := range append(ids, "junk") {
					for j := 0; j < 2; j++ {
						fk := fmt.Sprintf("f:%s:%d", id, j)
						fv, _ := c.Get(ctx, fk).Result()
						fx, _ := c.Do(ctx, "PEXPIRETIME", fk).Int64()
						for _, gk := range []string{"g" + fk[1:], "l" + fk[1:]} {
							gv, _ := c.Get(ctx, gk).Result()
							gx, _ := c.Do(ctx, "PEXPIRETIME", gk).Int64()
							if fv != gv || fx != gx {
								t.Fatalf("step %d: %s holds %q (expires %d), %s holds %q (expires %d)", step, fk, fv, fx, gk, gv, gx)
							}
						}
					}
				}
			}
			for _, k := range []string{"admitted", "held", "rejected", "failed"} {
				if seen[k] == 0 {
					t.Errorf("no decision %s in the sequence (%v): it tests less than it says", k, seen)
				}
			}
		})
	}
}

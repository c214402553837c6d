package ratelimit

import (
	"context"
	"math"
	"math/rand"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// gcraKey drives one gcra key through the scripts themselves: a rate of n
// per w, burst n, requests of cost 1.
type gcraKey struct {
	t    *testing.T
	c    *redis.Client
	key  string
	n, w int64 // w in µs
	hold int64 // µs
}

// gcraAdm is one admission: its moment and what the return needs.
type gcraAdm struct{ at, tat, sum int64 }

func (k *gcraKey) admit() (gcraAdm, bool) {
	k.t.Helper()
	res, err := decideOnce(context.Background(), k.c, gcraScript, []string{k.key}, 1, k.hold, 0, k.n, k.w, k.n).Result()
	if err != nil || len(res) != 6 {
		k.t.Fatalf("decision: %v %v", res, err)
	}
	return gcraAdm{at: res[1], tat: res[4], sum: res[5]}, res[0] >= 0
}

func (k *gcraKey) mustAdmit() gcraAdm {
	k.t.Helper()
	a, ok := k.admit()
	if !ok {
		k.t.Fatal("rejected, want admitted")
	}
	return a
}

func (k *gcraKey) giveBack(a gcraAdm) {
	k.t.Helper()
	if err := gcraReturnScript.Run(context.Background(), k.c, []string{k.key}, 1, k.n, k.w, k.n, a.tat, a.sum).Err(); err != nil {
		k.t.Fatal(err)
	}
}

// state is the key's TAT and S (0 without returns), and its raw value.
func (k *gcraKey) state() (tat float64, sum int64, raw string) {
	k.t.Helper()
	raw = k.c.Get(context.Background(), k.key).Val()
	f := strings.Fields(raw)
	if len(f) == 0 {
		return 0, 0, raw
	}
	tat, _ = strconv.ParseFloat(f[0], 64)
	if len(f) > 1 {
		sum, _ = strconv.ParseInt(f[1], 10, 64)
	}
	return tat, sum, raw
}

func (k *gcraKey) now() int64 {
	return k.c.Time(context.Background()).Val().UnixMicro()
}

// TestRateLimitGCRAReturnExact: returns of overlapping admissions give back
// exactly what is left of each in the key's schedule, in any order, never
// a unit of another admission, and never to a later incarnation of the key.
func TestRateLimitGCRAReturnExact(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	const sec = int64(time.Second / time.Microsecond)
	// X and R admitted together (burst 2); X returns; B is admitted and
	// counts; then R returns. R's units moved to where X's were, and so
	// did B's: B keeps a whole unit from no earlier than its own arrival.
	// Taking R's cost off the TAT regardless would start B's unit before B
	// came (a unit given to nobody).
	t.Run("middle", func(t *testing.T) {
		t.Parallel()
		k := &gcraKey{t: t, c: r.Client(), key: "x:{a}:middle", n: 2, w: 100 * sec}
		x, rr := k.mustAdmit(), k.mustAdmit()
		time.Sleep(100 * time.Millisecond)
		k.giveBack(x)
		time.Sleep(100 * time.Millisecond)
		b := k.mustAdmit()
		if b.sum == 0 {
			t.Fatal("the decision after a return answered S = 0")
		}
		time.Sleep(100 * time.Millisecond)
		before := k.now()
		k.giveBack(rr)
		after := k.now()
		tat, _, raw := k.state()
		T := float64(50 * sec)
		if tat < float64(b.at)+T || tat > float64(after)+T {
			t.Fatalf("TAT %.0f (%s) after both returns, want one unit from no earlier than B's arrival %d and no later than %d: B's unit alone (return at %d)", tat, raw, b.at, after, before)
		}
	})
	// Three overlapping admissions return in every order: the quota is
	// whole again (all but what drained while they ran, which is back by
	// the time the last one returned).
	for _, order := range [][3]int{{0, 1, 2}, {2, 1, 0}, {1, 2, 0}, {2, 0, 1}} {
		t.Run("order"+strconv.Itoa(order[0])+strconv.Itoa(order[1])+strconv.Itoa(order[2]), func(t *testing.T) {
			t.Parallel()
			k := &gcraKey{t: t, c: r.Client(), key: "x:{a}:o" + strconv.Itoa(order[0]*9+order[1]*3+order[2]), n: 3, w: 60 * sec}
			adm := [3]gcraAdm{k.mustAdmit(), k.mustAdmit(), k.mustAdmit()}
			if _, ok := k.admit(); ok {
				t.Fatal("a fourth admitted against rate 3 per minute")
			}
			for _, i := range order {
				time.Sleep(20 * time.Millisecond)
				k.giveBack(adm[i])
			}
			if tat, _, raw := k.state(); tat > float64(k.now()) {
				t.Fatalf("TAT %s after every admission returned, want in the past (a full quota)", raw)
			}
			for i := 0; i < 3; i++ {
				k.mustAdmit()
			}
			if _, ok := k.admit(); ok {
				t.Fatal("a fourth admitted after the returns")
			}
		})
	}
	// The key expired between an admission and its return, and a new
	// request made it again: nothing of the new one is given away.
	t.Run("expired", func(t *testing.T) {
		t.Parallel()
		k := &gcraKey{t: t, c: r.Client(), key: "x:{a}:expired", n: 1, w: sec}
		old := k.mustAdmit()
		time.Sleep(1200 * time.Millisecond)
		k.mustAdmit()
		_, _, want := k.state()
		k.giveBack(old)
		if _, _, got := k.state(); got != want {
			t.Fatalf("a return from before the key expired changed the new key: %s, was %s", got, want)
		}
	})
	// Returns lowered the TAT of a key with an admission P still in its
	// schedule; a later admission must not let the key expire before P's
	// TAT (a new incarnation would restart S, and P's return would give
	// away the new key's units).
	t.Run("lifetime", func(t *testing.T) {
		t.Parallel()
		// Units of 2 s: the case below needs P's TAT still ahead once
		// the key's TAT has passed, with room for a loaded machine.
		k := &gcraKey{t: t, c: r.Client(), key: "x:{a}:lifetime", n: 3, w: 6 * sec}
		q, rr, p := k.mustAdmit(), k.mustAdmit(), k.mustAdmit()
		k.giveBack(q)
		k.giveBack(rr)
		k.mustAdmit() // its TAT is about a unit (2 s) before P's
		if at, err := k.c.Do(context.Background(), "PEXPIRETIME", k.key).Int64(); err != nil || at*1000 < p.tat {
			t.Fatalf("the key expires at %d ms (%v), want no earlier than the TAT P wrote (%d µs)", at, err, p.tat)
		}
		// Once the TAT is in the past (a full quota) but P's is not,
		// the key is still the same one: a new request and P's return
		// leave that request's unit alone.
		tat, _, _ := k.state()
		if wait := time.Duration(int64(tat)-k.now())*time.Microsecond + 100*time.Millisecond; wait > 0 {
			time.Sleep(wait)
		}
		if k.now() >= p.tat-200_000 {
			t.Fatalf("the key's TAT passed only %d µs before P's: too late to test the case", p.tat-k.now())
		}
		k.mustAdmit()
		_, _, want := k.state()
		k.giveBack(p)
		if _, _, got := k.state(); got != want {
			t.Fatalf("P's return changed the key: %s, was %s", got, want)
		}
		if ttl := k.c.PTTL(context.Background(), k.key).Val(); ttl <= 0 || ttl > 6*time.Second {
			t.Fatalf("PTTL %v, want bounded by the schedule", ttl)
		}
	})
	// With wait, a waiter in the middle gives nothing back (a later waiter
	// holds its moment); the last one gives its slot back, and a newcomer
	// gets that very moment.
	t.Run("wait", func(t *testing.T) {
		t.Parallel()
		k := &gcraKey{t: t, c: r.Client(), key: "x:{a}:wait", n: 1, w: sec, hold: 5 * sec}
		k.mustAdmit()
		w2, w3 := k.mustAdmit(), k.mustAdmit()
		tat0, _, raw0 := k.state()
		k.giveBack(w2)
		if tat, _, raw := k.state(); tat != tat0 {
			t.Fatalf("a middle waiter's return moved the TAT: %s, was %s", raw, raw0)
		}
		k.giveBack(w3)
		if tat, _, raw := k.state(); tat != tat0-float64(sec) {
			t.Fatalf("the last waiter's return: %s, want its slot back (was %s)", raw, raw0)
		}
		if n := k.mustAdmit(); n.at < w3.at-1000 || n.at > w3.at+1000 {
			t.Fatalf("the newcomer got the moment %d, want the one the last waiter left (%d)", n.at, w3.at)
		}
	})
}

// TestPeekGCRAWithReturns: the admin API reads a key with returns ("TAT S
// X" and the kept returns) as its TAT alone.
func TestPeekGCRAWithReturns(t *testing.T) {
	t.Parallel()
	s := Rate{N: 4, Window: 4 * time.Second, Burst: 4}
	u1, r1, z1 := GCRA.peek("3000000", 1_000_000, s)
	u2, r2, z2 := GCRA.peek("3000000 7000 5000 1800000 1000", 1_000_000, s)
	if u1 != 2 || u1 != u2 || r1 != r2 || z1 != z2 {
		t.Fatalf("plain %d %d %v, with returns %d %d %v; want the same, 2 used", u1, r1, z1, u2, r2, z2)
	}
}

// TestRateLimitGCRAReturnBesideAWaiter: handlers that share a key may
// differ in `wait`. A return from one without `wait` must not move the units
// of a request another handler holds for a later moment: a waiter pending
// on the key makes every return give back only while it is the latest.
// Before, the returning handler's own setting decided, and a newcomer was
// scheduled 23 ms after the waiter under burst 1, 1 per second.
func TestRateLimitGCRAReturnBesideAWaiter(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	const sec = int64(time.Second / time.Microsecond)
	plain := &gcraKey{t: t, c: r.Client(), key: "x:{a}:mixed", n: 1, w: sec}
	held := &gcraKey{t: t, c: r.Client(), key: plain.key, n: 1, w: sec, hold: 5 * sec}
	rr := plain.mustAdmit() // passes now; its answer will not count
	q := held.mustAdmit()   // held until about now + 1s
	plain.giveBack(rr)
	n := held.mustAdmit()
	if gap := n.at - q.at; gap < sec-1000 {
		t.Fatalf("a newcomer was scheduled %d µs after the waiter, under burst 1, 1 per second", gap)
	}
}

// TestRateLimitGCRAReturnBesideAWaiterOfAnotherRate: a request held by one
// rate of a limit is pending on all of them; a return then gives back only
// while it is the latest on every rate. Before, each rate judged from its
// own TAT: rate i (5/s, burst 4) did not show the waiter that rate j (10/s,
// burst 1) held, took the return from the middle, and then let 8 units
// pass within 0.7 s (burst + t·n/w allows 7.5).
func TestRateLimitGCRAReturnBesideAWaiterOfAnotherRate(t *testing.T) {
	// Not parallel: it measures admissions against the rate on the client's clock, which a machine busy with 15 other tests cannot promise.
	r := testredis.Start(t)
	c := r.Client()
	ctx := context.Background()
	const sec = int64(time.Second / time.Microsecond)
	keys := []string{"two:{a}:j", "two:{a}:i"}
	rates := []int64{10, sec, 1, 5, sec, 4} // n, w, burst of j, then of i
	admit := func() []int64 {
		t.Helper()
		argv := []any{1, 5 * sec, 0} // cost, hold, no ban
		for _, v := range rates {
			argv = append(argv, v)
		}
		res, err := decideOnce(ctx, c, gcraScript, keys, argv...).Result()
		if err != nil || res[0] < 0 {
			t.Fatalf("decision: %v %v", res, err)
		}
		return res
	}
	rr := admit() // passes now; its answer will not count
	passes := []int64{rr[1], admit()[1]}
	argv := []any{1}
	for i := 0; i < 2; i++ {
		argv = append(argv, rates[3*i], rates[3*i+1], rates[3*i+2], rr[4+4*i], rr[5+4*i])
	}
	if err := gcraReturnScript.Run(ctx, c, keys, argv...).Err(); err != nil {
		t.Fatal(err)
	}
	for n := 0; n < 8; n++ {
		passes = append(passes, admit()[1])
	}
	sort.Slice(passes, func(a, b int) bool { return passes[a] < passes[b] })
	for a := range passes { // rate i, counting the returned request in full
		for b := a; b < len(passes); b++ {
			if units, allowed := float64(b-a+1), 4+float64(passes[b]-passes[a])/float64(sec/5); units > allowed+0.01 {
				t.Fatalf("rate i (5/s, burst 4): %v units passed in %v µs, at most %.2f allowed", units, passes[b]-passes[a], allowed)
			}
		}
	}
}

// gcraStepProbe runs the Lua arithmetic of ratelimit_gcra_step.lua on
// sextuples of ARGV (tat, now, cost, n, w, burst) and answers, per
// sextuple, what the decision script computes of them: the moment the
// request may pass, the TAT once admitted then, and the quota left and when
// it grows at now on the key as it is and as it would be, as %.17g (exact
// for a double).
var gcraStepProbe = redisconn.NewScript(gcraStepLua + `
local out, fmt = {}, string.format
for i = 1, #ARGV, 6 do
	local tat, now, cost = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
	local n, w, burst = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
	local u = w / n
	local tau = burst * u
	local held = math.max(tat, now)
	local at = gcra_at(held, cost, u, tau)
	local after = gcra_after(held, at, cost, u)
	local rem, grows = gcra_left(held, now, u, tau, burst)
	local rem2, grows2 = gcra_left(after, now, u, tau, burst)
	out[#out + 1] = fmt('%.17g %.17g %.17g %.17g %.17g %.17g', at, after, rem, grows, rem2, grows2)
end
return out
`)

// TestGCRAStepGoAndLuaAgree: the GCRA arithmetic exists once in Go
// (gcraAt, gcraAfter, gcraLeft: the local limiter, the admin API's read)
// and once in Lua (ratelimit_gcra_step.lua: the decision and the charge
// scripts). Both run on the same random inputs (keys drained and in debt,
// whole and fractional TATs, units of one µs and of hours, bursts below and
// above n) and must give the same doubles to the last bit.
func TestGCRAStepGoAndLuaAgree(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	rng := rand.New(rand.NewSource(20261207))
	type input struct{ tat, now, cost, n, w, burst float64 }
	var ins []input
	var argv []any
	for len(ins) < 2000 {
		n := []float64{1, 3, 7, 10, 1000, 1000000}[rng.Intn(6)]
		w := []float64{1000000, 60000000, 7000001, 3600000000}[rng.Intn(4)]
		if w < n {
			continue // one unit per µs at most (gcra.CheckRate)
		}
		burst := float64(1 + rng.Int63n(int64(2*n)))
		in := input{now: float64(1_765_000_000_000_000 + rng.Int63n(1_000_000_000)), cost: float64(1 + rng.Int63n(int64(burst))), n: n, w: w, burst: burst}
		in.tat = in.now + (rng.Float64()*5-2)*w
		if rng.Intn(2) == 0 {
			in.tat = math.Floor(in.tat) // a TAT written whole
		}
		ins = append(ins, in)
		for _, v := range []float64{in.tat, in.now, in.cost, in.n, in.w, in.burst} {
			argv = append(argv, strconv.FormatFloat(v, 'g', -1, 64))
		}
	}
	res, err := gcraStepProbe.Run(t.Context(), r.Client(), nil, argv...).StringSlice()
	if err != nil || len(res) != len(ins) {
		t.Fatalf("the Lua arithmetic: %d answers, %v", len(res), err)
	}
	for i, in := range ins {
		u := in.w / in.n
		tau := in.burst * u
		held := math.Max(in.tat, in.now)
		at := gcraAt(held, in.cost, u, tau)
		after := gcraAfter(held, at, in.cost, u)
		rem, grows := gcraLeft(held, in.now, u, tau, int64(in.burst))
		rem2, grows2 := gcraLeft(after, in.now, u, tau, int64(in.burst))
		want := []float64{at, after, float64(rem), grows, float64(rem2), grows2}
		for j, f := range strings.Fields(res[i]) {
			got, err := strconv.ParseFloat(f, 64)
			if err != nil || got != want[j] {
				t.Fatalf("input %+v: Lua answered %s, Go %v (value %d differs)", in, res[i], want, j)
			}
		}
	}
}

package ratelimit

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// slidingReferenceLua is the first sliding_window script, which reads the log
// 8 or 24 bytes at a time and always writes with SETRANGE: the reference
// that internal/ratelimit/scripts/ratelimit_sliding.lua (which reads a prefix of the log at once
// and writes a short log with one SET) must agree with.
var slidingReferenceLua = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local HDR = 24

local function slot(s, j)
	return (struct.unpack('>d', redis.call('GETRANGE', s.k, HDR + 8 * j, HDR + 7 + 8 * j)))
end

local st = {}
local admit = 1
local wait = 0
for i = 1, #KEYS do
	local n = tonumber(ARGV[2 * i - 1])
	local w = tonumber(ARGV[2 * i])
	local s = {k = KEYS[i], n = n, w = w, pos = 0, lo = 0, rec = now}
	local h = redis.call('GETRANGE', s.k, 0, HDR - 1)
	if #h == HDR then
		s.pos, s.lo, s.last = struct.unpack('>ddd', h)
		-- Same microsecond (or a clock step back): keep times unique and
		-- increasing by recording a little later, which only makes it stricter.
		if s.last >= now then
			s.rec = s.last + 1
		end
	end
	if s.pos >= n then
		local oldest = slot(s, s.pos % n)
		if oldest >= s.rec - w then
			s.wait = oldest + w + 1 - now
			admit = 0
			if s.wait > wait then
				wait = s.wait
			end
		end
	end
	st[i] = s
end

local out = {admit, wait}
for i = 1, #KEYS do
	local s = st[i]
	if s.wait then
		out[2 * i + 1] = 0
		out[2 * i + 2] = s.wait
	else
		-- Find the first admission at or after now - w: step on from the
		-- hint a few times, else binary search the rest of the ring.
		local thr = now - s.w
		local lo, hi = math.max(s.lo, s.pos - s.n), s.pos
		local first = nil
		if s.last == nil or s.last < thr then
			lo = hi
		else
			local steps = 0
			while lo < hi do
				local v = slot(s, lo % s.n)
				if v >= thr then
					first = v
					break
				end
				lo = lo + 1
				steps = steps + 1
				if steps == 4 then
					while lo < hi do
						local mid = math.floor((lo + hi) / 2)
						if slot(s, mid % s.n) >= thr then
							hi = mid
						else
							lo = mid + 1
						end
					end
					break
				end
			end
		end
		local inwin = s.pos - lo
		if inwin > 0 and not first then
			first = slot(s, lo % s.n)
		end
		if admit == 1 then
			local j = s.pos % s.n
			redis.call('SETRANGE', s.k, HDR + 8 * j, struct.pack('>d', s.rec))
			redis.call('SETRANGE', s.k, 0, struct.pack('>ddd', s.pos + 1, lo, s.rec))
			-- The log matters while its newest admission is in a window.
			redis.call('PEXPIREAT', s.k, math.ceil((s.rec + s.w + 1) / 1000))
			inwin = inwin + 1
			first = first or s.rec
		end
		out[2 * i + 1] = math.max(0, s.n - inwin)
		if first then
			out[2 * i + 2] = first + s.w + 1 - now
		else
			out[2 * i + 2] = 0
		end
	end
end
return out
`)

// TestRateLimitSlidingScriptMatchesReference runs the sliding_window script
// and the reference on copies of the same logs (short and long, wrapped and
// not, with admissions in and out of the window, one or two rates) and
// compares their answers and the logs they leave. The logs' times lie
// seconds away from the window's edge, so the microseconds between the two
// calls change no decision; times derived from "now" may differ by a little.
func TestRateLimitSlidingScriptMatchesReference(t *testing.T) {
	// Not parallel: it compares the script with a reference model to the millisecond of Redis TIME, which a machine busy with 15 other tests cannot promise.
	r := testredis.Start(t)
	c := r.Client()
	ctx := context.Background()
	const w = int64(time.Hour / time.Microsecond)
	const tol = int64(200 * time.Millisecond / time.Microsecond)
	rng := rand.New(rand.NewSource(1))

	redisNow := func() int64 {
		tm, err := c.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		return tm.UnixMicro()
	}
	f64 := func(v float64) []byte { return binary.BigEndian.AppendUint64(nil, math.Float64bits(v)) }
	// mkLog builds a log of rate n holding admissions 0..pos-1 (the last n
	// of them in the ring); admission times are whole seconds before now,
	// the newest at most 1.5w ago.
	mkLog := func(n, pos int, now int64) []byte {
		if pos == 0 {
			return nil
		}
		kept := min(pos, n)
		span := int(3 * w / 2 / 1e6) // seconds
		secs := rng.Perm(span)[:kept]
		// sort descending ages: oldest first
		for i := 1; i < len(secs); i++ {
			for j := i; j > 0 && secs[j] > secs[j-1]; j-- {
				secs[j], secs[j-1] = secs[j-1], secs[j]
			}
		}
		times := make([]float64, kept)
		for i, s := range secs {
			times[i] = float64(now - int64(s+1)*1e6 - 500_000) // half a second off any edge
		}
		// The hint: some admission at or before the first in the window.
		first := kept
		for i, tm := range times {
			if int64(tm) >= now-w {
				first = i
				break
			}
		}
		lo := pos - kept + rng.Intn(first+1)
		ring := make([]byte, 24+8*kept)
		copy(ring, append(append(f64(float64(pos)), f64(float64(lo))...), f64(times[kept-1])...))
		for i, tm := range times {
			j := (pos - kept + i) % n
			copy(ring[24+8*j:], f64(tm))
		}
		return ring
	}
	readLog := func(key string) []byte {
		b, err := c.Get(ctx, key).Bytes()
		if err != nil && err != redis.Nil {
			t.Fatal(err)
		}
		return b
	}
	near := func(a, b float64) bool { return math.Abs(a-b) <= float64(tol) }

	sizes := []int{1, 2, 5, 28, 29, 30, 31, 64, 200}
	for round := 0; round < 400; round++ {
		nrates := 1 + rng.Intn(2)
		ns := make([]int, nrates)
		poss := make([]int, nrates)
		for i := range ns {
			ns[i] = sizes[rng.Intn(len(sizes))]
			poss[i] = rng.Intn(3*ns[i] + 2)
		}
		now := redisNow()
		var keysA, keysB []string
		var args []any
		for i := range ns {
			ka, kb := "ref:{a}:"+string(rune('0'+i)), "new:{b}:"+string(rune('0'+i))
			if err := c.Del(ctx, ka, kb).Err(); err != nil {
				t.Fatal(err)
			}
			if log := mkLog(ns[i], poss[i], now); log != nil {
				c.Set(ctx, ka, log, time.Hour)
				c.Set(ctx, kb, log, time.Hour)
			}
			keysA, keysB = append(keysA, ka), append(keysB, kb)
			args = append(args, ns[i], w)
		}
		ra, err := slidingReferenceLua.Run(ctx, c, keysA, args...).Int64Slice()
		if err != nil {
			t.Fatal(err)
		}
		// The script takes cost 1, no hold and no ban first.
		res, err := decideOnce(ctx, c, slidingScript, keysB, append([]any{1, 0, 0}, args...)...).Result()
		if err != nil {
			t.Fatal(err)
		}
		// As the reference answers: admitted 1|0, the hold or wait, then
		// the rates (without the time recorded).
		rb := []int64{0, -res[0]}
		if res[0] >= 0 {
			rb = []int64{1, res[0]}
		}
		rb = append(rb, res[2:]...)
		for i := range ns {
			if rb[2+2*i] < 0 { // a rate that rejects: -(remaining+1)
				rb[2+2*i] = -rb[2+2*i] - 1
			}
		}
		what := func() string {
			return fmt.Sprintf("round %d, n %v, pos %v: reference %v, script %v", round, ns, poss, ra, rb)
		}
		if len(ra) != len(rb) || ra[0] != rb[0] || !near(float64(ra[1]), float64(rb[1])) {
			t.Fatalf("%s", what())
		}
		for i := range ns {
			if ra[2+2*i] != rb[2+2*i] || !near(float64(ra[3+2*i]), float64(rb[3+2*i])) {
				t.Fatalf("rate %d: %s", i, what())
			}
			la, lb := readLog(keysA[i]), readLog(keysB[i])
			if len(la) != len(lb) {
				t.Fatalf("rate %d: log of %d bytes, reference %d: %s", i, len(lb), len(la), what())
			}
			for off := 0; off+8 <= len(la); off += 8 {
				va := math.Float64frombits(binary.BigEndian.Uint64(la[off:]))
				vb := math.Float64frombits(binary.BigEndian.Uint64(lb[off:]))
				if (off == 16 || off >= 24 && va > float64(now-tol)) && near(va, vb) {
					continue // the time recorded now: "now" of each call
				}
				if va != vb {
					t.Fatalf("rate %d: log byte %d holds %v, reference %v: %s", i, off, vb, va, what())
				}
			}
			if len(la) > 0 {
				ta, tb := c.PTTL(ctx, keysA[i]).Val(), c.PTTL(ctx, keysB[i]).Val()
				if d := ta - tb; d > 200*time.Millisecond || d < -200*time.Millisecond {
					t.Fatalf("rate %d: TTL %s, reference %s: %s", i, tb, ta, what())
				}
			}
		}
	}
}

package ratelimit

import (
	_ "embed"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

var (
	//go:embed scripts/ratelimit_gcra_step.lua
	gcraStepLua string
	//go:embed scripts/ratelimit_gcra.lua
	gcraLua string
	//go:embed scripts/ratelimit_gcra_return.lua
	gcraReturnLua string
	//go:embed scripts/ratelimit_gcra_charge.lua
	gcraChargeLua string

	// The decision body and the charge script run the arithmetic of
	// ratelimit_gcra_step.lua, put in front of each (Redis scripts cannot
	// include each other).
	gcraScript       = newDecisionScript(gcraStepLua+gcraLua, perGCRA)
	gcraReturnScript = redisconn.NewScript(gcraReturnLua)
	gcraChargeScript = redisconn.NewScript(gcraStepLua + gcraChargeLua)
)

// perGCRA is the integers a decision's answer has per rate (after its
// first two): remaining, reset, the TAT written, the key's sum of returns.
const perGCRA = 4

// gcra is the algorithm "gcra" (GCRA), the generic cell rate algorithm: a
// key holds one theoretical arrival time (TAT), so O(1) memory whatever n;
// a rate admits n per window sustained and bursts up to its burst: at most
// burst + t·n/window units in any interval t (scripts/ratelimit_gcra.lua).
type gcra struct{}

func (gcra) Name() string   { return "gcra" }
func (gcra) HasBurst() bool { return true }

func (gcra) CheckRate(r Rate) error {
	if err := checkRate(r); err != nil {
		return err
	}
	if int64(r.Window/time.Microsecond) < r.N {
		return fmt.Errorf("%d requests per %s is faster than gcra's resolution of one request per microsecond", r.N, r.Window)
	}
	return nil
}

// withDefaults: the burst is n unless given.
func (gcra) withDefaults(r Rate) Rate {
	if r.Burst <= 0 {
		r.Burst = r.N
	}
	return r
}

func (gcra) capacity(r Rate) int64 { return r.Burst }

// suffix is ":gcra:<n>/<window>:b<burst>".
func (gcra) suffix(r Rate) string {
	return fmt.Sprintf(":gcra:%d/%s:b%d", r.N, r.Window, r.Burst)
}

func (a gcra) parseSuffix(s string) (Rate, bool) {
	rest, ok := strings.CutPrefix(s, ":gcra:")
	if !ok {
		return Rate{}, false
	}
	i := strings.LastIndex(rest, ":b")
	if i < 0 {
		return Rate{}, false
	}
	burst, err := strconv.ParseInt(rest[i+2:], 10, 64)
	if err != nil || burst < 1 {
		return Rate{}, false
	}
	return parseRate(a, rest[:i], burst)
}

func (gcra) decision() *redisconn.Script { return gcraScript }

func (gcra) args(argv []any, r Rate) []any {
	return append(argv, r.N, r.Window.Microseconds(), r.Burst)
}

// returnCall: the cost, then per rate n, window, burst, the TAT the
// admission wrote and the key's sum of returns then, from its answer: by
// them a rate gives back only what is left of the admission in its
// schedule (scripts/ratelimit_gcra_return.lua).
func (gcra) returnCall(c *Call, p *Plan, d Decision) {
	c.script = gcraReturnScript
	c.argv = make([]any, 0, 1+5*len(p.Rates))
	c.argv = append(c.argv, p.Cost)
	for i, r := range p.Rates {
		c.argv = append(c.argv, r.N, r.Window.Microseconds(), r.Burst, d.ans[4+4*i], d.ans[5+4*i])
	}
}

func (gcra) chargeScript() *redisconn.Script { return gcraChargeScript }
func (gcra) chargeArgs(r Rate) []any         { return []any{r.N, r.Window.Microseconds(), r.Burst} }

// horizon: the longer of the window and the burst's span.
func (gcra) horizon(r Rate) time.Duration {
	if r.Burst > r.N {
		return time.Duration(float64(r.Window) * float64(r.Burst) / float64(r.N))
	}
	return r.Window
}

// admitLocally replays the buckets into a TAT at the share's rate, each
// bucket's admissions at its end (a little stricter), one unit costing
// window ÷ share.
func (gcra) admitLocally(l *Local, e *localRate, cost, instances int64, now time.Time) localStep {
	share, burst := Share(e.rate.N, instances), Share(e.rate.Burst, instances)
	u := float64(e.rate.Window.Microseconds()) / float64(share)
	tau := float64(burst) * u
	cur := l.bucket(e, now)
	t := micros(now.Sub(l.epoch))
	tat := 0.0
	for b := cur - localBuckets; b <= cur; b++ {
		if c := e.count(b); c != 0 {
			tat = gcraAfter(tat, math.Min(micros(time.Duration(b+1)*e.width), t), float64(c), u)
		}
	}
	tat = math.Max(tat, t)
	s := localStep{share: share}
	var reset float64
	s.rem, reset = gcraLeft(tat, t, u, tau, burst)
	s.reset = fromMicros(reset)
	if cost > burst {
		return s // never at this share
	}
	// Half a µs of slack, as gcraLeft: t carries fractions of a µs, and
	// a TAT that meets its bound exactly may round a few ns above it.
	if at := gcraAt(tat, float64(cost), u, tau); at > t+0.5 {
		s.wait = fromMicros(math.Ceil(at - t))
		return s
	}
	s.ok = true
	return s
}

// peek reads a TAT ("TAT", or "TAT S X ..." once a return happened: the
// TAT comes first) as a decision at now would report it without admitting.
func (gcra) peek(raw string, now float64, r Rate) (used, remaining int64, reset float64) {
	if i := strings.IndexByte(raw, ' '); i >= 0 {
		raw = raw[:i]
	}
	tat, err := strconv.ParseFloat(raw, 64)
	if raw == "" || err != nil {
		return 0, r.Burst, 0
	}
	u := float64(r.Window.Microseconds()) / float64(r.N)
	rem, reset := gcraLeft(math.Max(tat, now), now, u, float64(r.Burst)*u, r.Burst)
	return r.Burst - rem, rem, reset
}

// The arithmetic of GCRA, in µs: u is the cost of one unit (window ÷ n),
// tau = burst·u the tolerance. It exists once for Go (here: the local
// limiter and the admin API's read) and once for Lua
// (scripts/ratelimit_gcra_step.lua: the decision and the charge), and
// TestGCRAStepGoAndLuaAgree runs both on the same inputs. The products are
// rounded on their own (float64(...)), as Lua does: Go may otherwise fuse
// a multiply and an add into one instruction, with another rounding.

// gcraAt is the earliest moment a request of cost may pass on a key whose
// TAT is tat.
func gcraAt(tat, cost, u, tau float64) float64 { return tat + float64(cost*u) - tau }

// gcraAfter is the TAT once an admission of cost at the moment at is in it.
func gcraAfter(tat, at, cost, u float64) float64 { return math.Max(tat, at) + float64(cost*u) }

// gcraLeft is the quota left at now on a key whose TAT is tat (not before
// now), 0 to burst, and µs until it grows (0: full). Half a microsecond of
// slack absorbs the rounding of µs-sized doubles.
func gcraLeft(tat, now, u, tau float64, burst int64) (rem int64, reset float64) {
	debt := tat - now
	rem = min(max(int64(math.Floor((tau-debt+0.5)/u)), 0), burst)
	if rem >= burst {
		return rem, 0
	}
	return rem, math.Max(1, math.Ceil(debt-tau+float64(float64(rem+1)*u)))
}

// micros is d in µs, fractions kept.
func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// fromMicros is µs as a Duration.
func fromMicros(us float64) time.Duration { return time.Duration(us * float64(time.Microsecond)) }

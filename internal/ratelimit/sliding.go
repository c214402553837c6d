package ratelimit

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

var (
	//go:embed scripts/ratelimit_sliding.lua
	slidingLua string
	//go:embed scripts/ratelimit_sliding_return.lua
	slidingReturnLua string
	//go:embed scripts/ratelimit_sliding_charge.lua
	slidingChargeLua string

	slidingScript       = newDecisionScript(slidingLua, perSliding)
	slidingReturnScript = redisconn.NewScript(slidingReturnLua)
	slidingChargeScript = redisconn.NewScript(slidingChargeLua)
)

// perSliding is the integers a decision's answer has per rate (after its
// first two): remaining, reset.
const perSliding = 2

// slidingWindow is the algorithm "sliding_window" (SlidingWindow): an
// exact sliding log. In any interval of one window at most n units are
// admitted; a key holds one 8-byte time per unit admitted in its window
// (scripts/ratelimit_sliding.lua).
type slidingWindow struct{}

func (slidingWindow) Name() string   { return "sliding_window" }
func (slidingWindow) HasBurst() bool { return false }

func (slidingWindow) CheckRate(r Rate) error {
	if err := checkRate(r); err != nil {
		return err
	}
	if r.N > MaxSlidingWindowRequests {
		return fmt.Errorf("%d requests is more than sliding_window accepts (%d): it keeps one 8-byte timestamp per admitted request per key in Redis; use algorithm gcra for larger rates", r.N, MaxSlidingWindowRequests)
	}
	return nil
}

func (slidingWindow) withDefaults(r Rate) Rate { r.Burst = 0; return r }
func (slidingWindow) capacity(r Rate) int64    { return r.N }

// suffix is ":sw:<n>/<window>".
func (slidingWindow) suffix(r Rate) string { return fmt.Sprintf(":sw:%d/%s", r.N, r.Window) }

func (a slidingWindow) parseSuffix(s string) (Rate, bool) {
	rest, ok := strings.CutPrefix(s, ":sw:")
	if !ok {
		return Rate{}, false
	}
	return parseRate(a, rest, 0)
}

func (slidingWindow) decision() *redisconn.Script { return slidingScript }

func (slidingWindow) args(argv []any, r Rate) []any {
	return append(argv, r.N, r.Window.Microseconds())
}

// returnCall: the time the admission was recorded at and its cost, then
// per rate n and window (scripts/ratelimit_sliding_return.lua).
func (slidingWindow) returnCall(c *Call, p *Plan, d Decision) {
	c.script = slidingReturnScript
	c.argv = make([]any, 0, 2+2*len(p.Rates))
	c.argv = append(c.argv, d.At, p.Cost)
	for _, r := range p.Rates {
		c.argv = append(c.argv, r.N, r.Window.Microseconds())
	}
}

func (slidingWindow) chargeScript() *redisconn.Script { return slidingChargeScript }
func (slidingWindow) chargeArgs(r Rate) []any         { return []any{r.N, r.Window.Microseconds()} }

func (slidingWindow) horizon(r Rate) time.Duration { return r.Window }

// admitLocally counts the admissions of every bucket that reaches into the
// window, so no interval of one window holds more than the share.
func (slidingWindow) admitLocally(l *Local, e *localRate, cost, instances int64, now time.Time) localStep {
	share := Share(e.rate.N, instances)
	cur := l.bucket(e, now)
	from := l.bucket(e, now.Add(-e.rate.Window))
	var used int64
	first := int64(-1)
	for b := from; b <= cur; b++ {
		if c := e.count(b); c > 0 {
			used += c
			if first < 0 {
				first = b
			}
		}
	}
	s := localStep{rem: max(0, share-used), share: share}
	// Bucket b leaves the window at epoch + (b+1)·width + window.
	leaves := func(b int64) time.Duration {
		return l.epoch.Add(time.Duration(b+1)*e.width + e.rate.Window).Sub(now)
	}
	if first >= 0 {
		s.reset = max(time.Microsecond, leaves(first))
	}
	if used+cost <= share {
		s.ok = true
		return s
	}
	if cost > share {
		return s // never at this share
	}
	need := used + cost - share
	for b := from; b <= cur; b++ {
		if need -= e.count(b); need <= 0 {
			s.wait = max(time.Microsecond, leaves(b))
			return s
		}
	}
	s.wait = e.rate.Window
	return s
}

// peek reads a log (scripts/ratelimit_sliding.lua: a 24-byte header {pos,
// lo, last}, then a ring of n 8-byte admission times in µs) as the script
// would count it at now: the admissions within the window, and µs until
// the oldest of them leaves it.
func (slidingWindow) peek(raw string, now float64, r Rate) (used, remaining int64, reset float64) {
	const hdr = 24
	remaining = r.N
	if len(raw) < hdr {
		return 0, remaining, 0
	}
	f := func(off int) float64 { return math.Float64frombits(binary.BigEndian.Uint64([]byte(raw[off : off+8]))) }
	pos := int64(f(0))
	w := float64(r.Window.Microseconds())
	thr := now - w
	first := -1.0
	for j := max(0, pos-r.N); j < pos; j++ {
		off := hdr + 8*int(j%r.N)
		if off+8 > len(raw) {
			break
		}
		if t := f(off); t >= thr {
			used++
			if first < 0 {
				first = t
			}
		}
	}
	remaining = max(0, r.N-used)
	if first >= 0 {
		reset = first + w + 1 - now
	}
	return used, remaining, reset
}

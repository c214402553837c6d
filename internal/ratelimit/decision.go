package ratelimit

import (
	"fmt"
	"time"
)

// parseDecision reads one decision's answer: {hold when admitted (>= 0), else
// minus the wait; time recorded when admitted, else the BanState; then per
// rate remaining, reset and, with per = 4 (gcra), the TAT written and the
// key's sum of returns}.
func parseDecision(vals []int64, nrates, per int) (Decision, error) {
	if per < 2 || len(vals) != 2+per*nrates || vals[0] == failedRead || vals[0] == failedRun ||
		vals[0] < 0 && (vals[1] < int64(NotBanned) || vals[1] > ordered) {
		return Decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v", vals)
	}
	d := Decision{Allowed: vals[0] >= 0, Tight: -1, ans: vals}
	if d.Allowed {
		d.Hold, d.At = time.Duration(vals[0])*time.Microsecond, vals[1]
	} else {
		d.Wait, d.Ban = time.Duration(-vals[0])*time.Microsecond, BanState(vals[1])
		if vals[1] == ordered {
			d.Ban, d.Ordered = NotBanned, true
		}
	}
	// The tightest rate: the least remaining, then the longest until it
	// grows; of a rejected request, among the rates that reject it (their
	// remaining comes as -(remaining+1)).
	for i := 0; i < nrates; i++ {
		rem, reset := vals[2+per*i], time.Duration(vals[3+per*i])*time.Microsecond
		rejects := rem < 0
		if rejects {
			rem = -rem - 1
		}
		if !d.Allowed && !rejects {
			continue
		}
		if d.Tight < 0 || rem < d.Remaining || rem == d.Remaining && reset > d.Reset {
			d.Tight, d.Remaining, d.Reset = i, rem, reset
		}
	}
	if d.Tight < 0 {
		return Decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v (rejected by no rate)", vals)
	}
	if d.Ban == Banned {
		// Every rate's reset is the ban's own end.
		d.BanLeft = time.Duration(vals[3]) * time.Microsecond
	}
	if d.Ban != NotBanned {
		// No quota until the ban ends, whatever the rates' state.
		d.Remaining, d.Reset = 0, d.Wait
	}
	return d, nil
}

// decision reads the answer of decision call c (Call.Decision).
func (c *Call) decision() (Decision, error) {
	if c.err != nil {
		return Decision{}, c.err
	}
	return parseDecision(c.res, len(c.keys), c.perRate())
}

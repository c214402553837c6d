package ratelimit

import (
	"fmt"
	"time"
)

// Decision is the outcome for one request.
type Decision struct {
	Allowed   bool
	Hold      time.Duration // admitted: how long to hold the request until its slot
	Wait      time.Duration // rejected: until the request would be admitted (0 = never)
	At        int64         // admitted: the time (µs, Redis TIME) it was recorded at
	Tight     int           // the rate reported in the RateLimit field
	Remaining int64         // of rate tight
	Reset     time.Duration // until rate tight's quota grows (0 = full)
	Ban       BanState      // rejected: whether by a ban (then Wait lasts until its end, or later, see BanLeft)
	// BanLeft: rejected under a ban that began before (Banned), until the
	// ban ends; Wait is later when the quota that started the ban admits
	// the request only after that.
	BanLeft time.Duration
	// Ordered: rejected, or rejected for longer than its quotas would, by
	// the order of a log (sliding_window): an admission another handler
	// holds until later comes first. Its slot may be given back at any
	// moment, so the rejection may not last.
	Ordered bool
	Cached  bool    // answered from the deny cache
	Ans     []int64 // the script's answer (settle reads what gcra wrote)
}

// ParseDecision reads one decision's answer: {hold when admitted (>= 0), else
// minus the wait; time recorded when admitted, else the BanState; then per
// rate remaining, reset and, with per = 4 (gcra), the TAT written and the
// key's sum of returns}.
func ParseDecision(vals []int64, nrates, per int) (Decision, error) {
	if per < 2 || len(vals) != 2+per*nrates || vals[0] == failedRead || vals[0] == failedRun ||
		vals[0] < 0 && (vals[1] < int64(NotBanned) || vals[1] > ordered) {
		return Decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v", vals)
	}
	d := Decision{Allowed: vals[0] >= 0, Tight: -1, Ans: vals}
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

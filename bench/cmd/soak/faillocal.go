package main

// The fail_local tier (docs/ratelimit.md "Local limits
// during an outage"): every Caddy has a route /fl/ with
// `redis_ratelimit { rate 20 1s fail_local }` on the single Redis, N learned
// from the heartbeats (4 instances), so each instance's local share is
// ceil(20 ÷ 4) = 5. Two clients hammer one key on random instances, well
// above the limit. The checker records each admission's bounds (X-Sent ..
// X-Admitted, as for /rl/) and the instance, and the fault schedule says
// when the single Redis was unreachable from every Caddy (SIGSTOP, kill -9
// until restarted, blackhole from every Caddy; also a reload of a Caddy,
// or a kill and an empty restart, during a SIGSTOP). Afterwards it asserts
// the bound, for every set of admissions surely decided within less than a
// window (n+1 proven within less than w, as the /rl/ check):
//
//   - near an outage (a window that meets it, or its return second):
//     at most Σ over instances of max(what Redis admitted through it in
//     the window, share), an admission counting as Redis's unless it was
//     surely decided inside the outage or its return second; and what was
//     surely decided by Redis, at most n. Redis restarted empty is no
//     exception: the instances charge their windows again;
//   - never none: every whole window inside [stop + 500ms, back] (after the
//     first call's timeout moved the instances to local mode) holds an
//     admission;
//   - near a partial failure, where some instances decide locally and the
//     checker cannot tell which (a blackhole from one Caddy, latency or
//     reset faults on the single Redis, whose calls may time out or fail,
//     and any /fl/ answer that took 250 ms or more, until a second after
//     it: a call that timed out on a loaded machine without a fault is
//     decided locally): the most that bound can be, n + (N−1)·share;
//   - elsewhere exact: n per window.

import (
	"fmt"
	"math/rand"
	"net/http"
	"sort"
	"strings"
	"time"
)

const (
	flRateN      = 20
	flRateWindow = time.Second
	flInstances  = 4
	flShare      = (flRateN + flInstances - 1) / flInstances
	// flSettle: after the fault's effect, the instances are local once the
	// first call timed out (timeout 300–400 ms).
	flSettle = 500 * time.Millisecond
	// flSlow: the route's timeout is 300–400 ms.
	flSlow = 250 * time.Millisecond
	// flReturn: decisions go back to Redis within a second (after a
	// restart empty, a heartbeat's life, 3 s, and that second).
	flReturn        = time.Second
	flRestartReturn = 3*time.Second + flReturn
)

// flAdmission is one admission on /fl/ as the checker saw it.
type flAdmission struct {
	lo, hi time.Duration // soak clock: X-Sent .. X-Admitted (ms, rounded up)
	inst   string
}

// flSpan is a stretch of the soak clock where the single Redis failed.
type flSpan struct {
	kind     string
	full     bool // unreachable from every Caddy
	from, to time.Duration
	back     time.Duration // how long after to the instances may still decide locally
}

// end is when the instances are surely back to Redis.
func (sp flSpan) end() time.Duration { return sp.to + sp.back }

type flState struct {
	adm   []flAdmission
	spans []flSpan
	// slow answers and the second after (flAnswer): windows that meet one are mixed
	localSeen []flSpan
	// figures for the report
	nearChecked, nearMax, nearBound, mixedMax, exactMax int
	noneChecked                                         int
}

// flRoute is the route of the tier; -no-fail-local drops fail_local (the
// route fails open: the checker must fail the run when Redis is down).
func (s *soak) flRoute(timeout, redis string) string {
	policy := "fail_local"
	if *noFailLocal {
		policy = "# fail open (-no-fail-local)"
	}
	return fmt.Sprintf("\thandle /fl/* {\n\t\tredis_ratelimit {\n\t\t\tkey {http.request.uri.path}\n\t\t\trate %d %s\n\t\t\t%s\n\t\t\ttimeout %s\n\t\t\tredis %s\n\t\t}\n\t\trequest_header X-Admitted {time.now.unix_ms}\n\t\treverse_proxy %s\n\t}\n",
		flRateN, flRateWindow, policy, timeout, redis, s.check.url)
}

// flWork hammers the key of the tier on random instances.
func (s *soak) flWork(id int, stop time.Time) {
	rng := rand.New(rand.NewSource(s.seed*1000 + 900 + int64(id)))
	for time.Now().Before(stop) {
		s.do(rng.Intn(len(s.caddies)), "/fl/k0", 0, 0)
		time.Sleep(time.Duration(5+rng.Intn(15)) * time.Millisecond)
	}
}

// flAnswer notes an answer of /fl/ that took flSlow or more: its call may
// have timed out (a loaded machine, without a fault), so it and the
// requests of its instance until the return to Redis may have been decided
// locally (the answers do not say: a local answer's RateLimit-Policy is the
// configured rate's).
func (s *soak) flAnswer(from, to time.Duration, _ http.Header) {
	if to-from < flSlow {
		return
	}
	s.check.mu.Lock()
	s.check.fl.localSeen = append(s.check.fl.localSeen, flSpan{kind: "slow answer", from: from, to: to + flReturn})
	s.check.mu.Unlock()
}

// flAdmit records an admission (the checker's mutex held).
func (c *checker) flAdmit(sent, admittedMs int64, inst string) {
	st := c.start.UnixMicro()
	c.fl.adm = append(c.fl.adm, flAdmission{
		lo:   time.Duration(sent-st) * time.Microsecond,
		hi:   time.Duration(admittedMs*1000+1000-st) * time.Microsecond,
		inst: inst,
	})
}

// flFault notes what fault f did to the single Redis between from (its
// effect began) and to (lifted).
func (s *soak) flFault(f fault, from, to time.Duration) {
	if f.redis != 0 {
		return
	}
	sp := flSpan{kind: f.kind, from: from, to: to, back: flReturn}
	switch f.kind {
	case fPause, fPauseReload:
		sp.full = true
	case fRestart, fPauseRestart:
		sp.full, sp.back = true, flRestartReturn
	case fBlackhole:
		sp.full = f.caddy < 0
	case fLatency, fReset:
	default:
		return
	}
	s.check.mu.Lock()
	s.check.fl.spans = append(s.check.fl.spans, sp)
	s.check.mu.Unlock()
}

// flWindows: every set of admissions of as (sorted by lo) whose bounds lie
// within less than w of one admission's lo, as [from, until] and the set.
func flWindows(as []flAdmission, w time.Duration, visit func(from, until time.Duration, in []flAdmission)) {
	for i, a := range as {
		var in []flAdmission
		until := a.lo
		for _, b := range as[i:] {
			if b.lo-a.lo >= w {
				break
			}
			if b.hi-a.lo < w {
				in = append(in, b)
				until = max(until, b.hi)
			}
		}
		if len(in) > 0 {
			visit(a.lo, until, in)
		}
	}
}

// flCheck runs the tier's checks and adds the events of broken promises.
func (s *soak) flCheck() {
	c := s.check
	c.mu.Lock()
	defer c.mu.Unlock()
	fl := &c.fl
	sort.Slice(fl.adm, func(i, j int) bool { return fl.adm[i].lo < fl.adm[j].lo })
	ev := func(at, until time.Duration, what, detail string) {
		c.events = append(c.events, event{at: at, until: until, what: what, backend: "faillocal", key: "/fl/k0", detail: detail})
	}
	flWindows(fl.adm, flRateWindow, func(from, until time.Duration, in []flAdmission) {
		full, partial := fl.near(from, until)
		n := len(in)
		switch {
		case partial:
			fl.mixedMax = max(fl.mixedMax, n)
			if bound := flRateN + (flInstances-1)*flShare; n > bound {
				ev(from, until, "fleet limit", fmt.Sprintf("%d admissions surely within %v near a failure of the single Redis (bound n + (N−1)·share = %d)", n, until-from, bound))
			}
		case len(full) > 0:
			fl.nearChecked++
			bound, redis := fl.bound(in, full)
			if n > fl.nearMax {
				fl.nearMax, fl.nearBound = n, bound
			}
			if n > bound {
				ev(from, until, "local limit", fmt.Sprintf("%d admissions surely within %v near an outage of the single Redis (%s), %v by instance; bound Σ max(through Redis, share) = %d",
					n, until-from, fl.describe(full), flPerInstance(in), bound))
			}
			if redis > flRateN {
				ev(from, until, "fleet limit", fmt.Sprintf("%d admissions surely decided by Redis within %v near an outage of the single Redis (%s); limit %d", redis, until-from, fl.describe(full), flRateN))
			}
		default:
			fl.exactMax = max(fl.exactMax, n)
			if n > flRateN {
				ev(from, until, "fleet limit", fmt.Sprintf("%d admissions surely within %v (limit %d per %v)", n, until-from, flRateN, flRateWindow))
			}
		}
	})
	for _, sp := range fl.spans {
		if sp.full {
			fl.checkNone(sp, ev)
		}
	}
}

// near reports the outages whose [from − w, end + w] the window [from,
// until] meets, and whether it meets a partial failure or a slow answer.
func (fl *flState) near(from, until time.Duration) (full []flSpan, partial bool) {
	w := flRateWindow
	for _, sp := range fl.spans {
		if from > sp.end()+w || until < sp.from-w {
			continue
		}
		if !sp.full {
			partial = true
			continue
		}
		full = append(full, sp)
	}
	for _, sp := range fl.localSeen {
		if from <= sp.to && until >= sp.from {
			partial = true
		}
	}
	return full, partial
}

// bound is the bound of a window near the outages full: Σ over instances
// of max(what Redis admitted through it in the window, share), where an
// admission counts as Redis's unless it was surely decided inside an
// outage or its return (a Redis decision counted as local only makes the
// bound stricter); and redis, the admissions surely decided by Redis
// (outside every outage and its return).
func (fl *flState) bound(in []flAdmission, full []flSpan) (bound, redis int) {
	via := map[string]int{}
	for _, a := range in {
		local, outside := false, true
		for _, sp := range full {
			local = local || a.lo >= sp.from && a.hi <= sp.end()
			outside = outside && (a.hi < sp.from || a.lo > sp.end())
		}
		if !local {
			via[a.inst]++
		}
		if outside {
			redis++
		}
	}
	for i := range flInstances {
		bound += max(via[fmt.Sprint(i)], flShare)
	}
	return bound, redis
}

// checkNone: every whole window in [from + settle, to] of outage sp holds
// an admission.
func (fl *flState) checkNone(sp flSpan, ev func(at, until time.Duration, what, detail string)) {
	w := flRateWindow
	if sp.to-sp.from-flSettle < w {
		return
	}
	fl.noneChecked++
	last, gapEnd := sp.from+flSettle, sp.to
	for _, a := range fl.adm {
		if a.hi < last {
			continue
		}
		if a.lo > sp.to {
			break
		}
		if a.lo-last >= w {
			gapEnd = a.lo
			break
		}
		last = max(last, a.hi)
	}
	if gapEnd-last >= w {
		ev(last, gapEnd, "none admitted", fmt.Sprintf("no admission in %v from %.3fs while the single Redis was unreachable (%s %.3fs–%.3fs)",
			gapEnd-last, last.Seconds(), sp.kind, sp.from.Seconds(), sp.to.Seconds()))
	}
}

// describe names outages in an event.
func (fl *flState) describe(spans []flSpan) string {
	var parts []string
	for _, sp := range spans {
		parts = append(parts, fmt.Sprintf("%s %.3fs–%.3fs", sp.kind, sp.from.Seconds(), sp.to.Seconds()))
	}
	return strings.Join(parts, "; ")
}

// flPerInstance counts admissions by instance.
func flPerInstance(as []flAdmission) map[string]int {
	m := map[string]int{}
	for _, a := range as {
		m[a.inst]++
	}
	return m
}

// flSummary is the report's line on the tier.
func (s *soak) flSummary() string {
	c := s.check
	c.mu.Lock()
	defer c.mu.Unlock()
	fl := &c.fl
	full := 0
	for _, sp := range fl.spans {
		if sp.full {
			full++
		}
	}
	return fmt.Sprintf("%d admissions, %d slow answers (maybe local); %d outages of the single Redis (%d spans of failures): busiest window near an outage %d (its bound Σ max(through Redis, share) %d), %d windows checked; near partial failures %d (bound %d); elsewhere %d (limit %d); %d outages long enough for the never-none check",
		len(fl.adm), len(fl.localSeen), full, len(fl.spans), fl.nearMax, fl.nearBound, fl.nearChecked,
		fl.mixedMax, flRateN+(flInstances-1)*flShare, fl.exactMax, flRateN, fl.noneChecked)
}

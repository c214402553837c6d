package main

// The fail_local tier (SPEC §4 item 12, docs/ratelimit.md "Local limits
// during an outage"): every Caddy has a route /fl/ with
// `redis_ratelimit { rate 20 1s fail_local }` on the single Redis, N learned
// from the heartbeats (4 instances), so each instance's local share is
// ceil(20 ÷ 4) = 5. Two clients hammer one key on random instances, well
// above the limit. The checker records each admission's bounds (X-Sent ..
// X-Admitted, as for /rl/) and the instance, and the fault schedule says
// when the single Redis was unreachable from every Caddy (SIGSTOP, kill -9
// until restarted, blackhole from every Caddy). Afterwards it asserts:
//
//   - while Redis is unreachable: admissions surely decided inside
//     [stop, back + 1s] (the fault's effect until it is lifted, plus the
//     second SPEC allows the return to Redis) never hold more than the
//     local bound Σ ceil(n ÷ N) = 20 within one window (n+1 proven within
//     less than w, as the /rl/ check), plus flReturnSlack when the window
//     reaches into that return second (below);
//   - never none: every whole window inside [stop + 500ms, back] (after the
//     first call's timeout moved the instances to local mode) holds an
//     admission;
//   - elsewhere exact: n per window, except in windows that meet a span
//     where some decisions are local and others Redis's ("mixed": the
//     window before an outage and its return, a blackhole from one Caddy,
//     latency or reset faults on the single Redis, whose calls may time out
//     or fail, and any /fl/ answer that took 250 ms or more, until a second
//     after it: a call that timed out on a loaded machine without a fault
//     is decided locally): there at most n + Σ shares − share (each instance admits at
//     most max(share, what Redis admitted through it) in a window, since
//     its local limiter starts from its own admissions; Redis at most n).
//
// A single Redis restarted empty drops Redis's window and the heartbeats:
// the windows after it (exSingleEmpty: outside, and those of its own outage
// that reach past the restart; those of its down time are checked) and outages that start within 4 s of
// it (N read from a heartbeat set that is filling up again may be under 4:
// a bigger share) are counted apart.

import (
	"fmt"
	"math/rand"
	"net/http"
	"sort"
	"time"
)

const (
	flRateN      = 20
	flRateWindow = time.Second
	flInstances  = 4
	flShare      = (flRateN + flInstances - 1) / flInstances
	// flReturnSlack: when Redis answers again the instances go back within
	// about a second, one after the other: one already back may be admitted
	// by Redis what another, still local, admitted but has not charged yet.
	// An admission per instance (as TestWholeCaddyFailLocal allows 22 of 20
	// over two instances around the return).
	flReturnSlack = flInstances
	// flSettle: after the fault's effect, the instances are local once the
	// first call timed out (timeout 300–400 ms).
	flSettle = 500 * time.Millisecond
	// flSlow: the route's timeout is 300–400 ms.
	flSlow = 250 * time.Millisecond
	// flReturn: SPEC: decisions go back to Redis within a second.
	flReturn = time.Second
	// flHeartbeatRefill: heartbeats live 3 s and are written every second:
	// after a restart empty, a count read within this may be under N.
	flHeartbeatRefill = 4 * time.Second
)

const exFlHeartbeats = "single Redis restarted empty shortly before: N read from the refilling heartbeat set may be under 4 (a bigger local share)"

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
}

type flState struct {
	adm     []flAdmission
	spans   []flSpan
	emptyAt []time.Duration // single Redis up again, empty
	// slow answers and the second after (flAnswer): windows that meet one are mixed
	localSeen []flSpan
	// figures for the report
	coreChecked, coreMax, mixedMax, exactMax int
	noneChecked                              int
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
	sp := flSpan{kind: f.kind, from: from, to: to}
	switch f.kind {
	case fPause, fRestart:
		sp.full = true
	case fBlackhole:
		sp.full = f.caddy < 0
	case fLatency, fReset:
	default:
		return
	}
	s.check.mu.Lock()
	s.check.fl.spans = append(s.check.fl.spans, sp)
	if f.kind == fRestart {
		s.check.fl.emptyAt = append(s.check.fl.emptyAt, to)
	}
	s.check.mu.Unlock()
}

// flWindows: every set of admissions of as (sorted by lo) whose bounds lie
// within less than w of one admission's lo, as [from, until] and count.
func flWindows(as []flAdmission, w time.Duration, visit func(from, until time.Duration, n int)) {
	for i, a := range as {
		var his []time.Duration
		for _, b := range as[i:] {
			if b.lo-a.lo >= w {
				break
			}
			if b.hi-a.lo < w {
				his = append(his, b.hi)
			}
		}
		if len(his) == 0 {
			continue
		}
		sort.Slice(his, func(x, y int) bool { return his[x] < his[y] })
		visit(a.lo, his[len(his)-1], len(his))
	}
}

// flCheck runs the tier's checks and adds the events of broken promises.
func (s *soak) flCheck() {
	c := s.check
	c.mu.Lock()
	defer c.mu.Unlock()
	fl := &c.fl
	sort.Slice(fl.adm, func(i, j int) bool { return fl.adm[i].lo < fl.adm[j].lo })
	w := flRateWindow
	ev := func(at, until time.Duration, what, detail string) {
		c.events = append(c.events, event{at: at, until: until, what: what, backend: "faillocal", key: "/fl/k0", detail: detail})
	}
	afterEmpty := func(t time.Duration) bool {
		for _, e := range fl.emptyAt {
			if t >= e && t < e+flHeartbeatRefill {
				return true
			}
		}
		return false
	}
	localBound := flShare * flInstances
	for _, sp := range fl.spans {
		if !sp.full {
			continue
		}
		// While unreachable (and the return second): the local bound.
		var in []flAdmission
		for _, a := range fl.adm {
			if a.lo >= sp.from && a.hi <= sp.to+flReturn {
				in = append(in, a)
			}
		}
		flWindows(in, w, func(from, until time.Duration, n int) {
			fl.coreChecked++
			fl.coreMax = max(fl.coreMax, n)
			limit := localBound
			if until > sp.to {
				limit += flReturnSlack
			}
			if n > limit {
				what := "local limit"
				switch {
				case sp.kind == fRestart && until > sp.to:
					// Back, but empty: Redis admits n afresh while the
					// instances still local spend what their own earlier
					// admissions left them (seen: 28).
					what = "local limit, Redis back empty"
				case afterEmpty(sp.from):
					what = "local limit after a restart empty"
				}
				ev(from, until, what, fmt.Sprintf("%d admissions surely within %v while the single Redis was unreachable (%s %.3fs–%.3fs; bound %d)",
					n, until-from, sp.kind, sp.from.Seconds(), sp.to.Seconds(), limit))
			}
		})
		// Never none: every whole window in [from + settle, to].
		if sp.to-sp.from-flSettle < w {
			continue
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
	// Elsewhere: exact, or the mixed bound near failures.
	mixedBound := flRateN + localBound - flShare
	mixed := func(from, until time.Duration) bool {
		for _, sp := range fl.spans {
			lo, hi := sp.from-w, sp.to+flReturn+w
			if from <= hi && until >= lo {
				return true
			}
		}
		for _, sp := range fl.localSeen {
			if from <= sp.to && until >= sp.from {
				return true
			}
		}
		return false
	}
	inCore := func(from, until time.Duration) bool {
		for _, sp := range fl.spans {
			if sp.full && from >= sp.from && until <= sp.to+flReturn {
				return true
			}
		}
		return false
	}
	flWindows(fl.adm, w, func(from, until time.Duration, n int) {
		if inCore(from, until) { // checked above
			return
		}
		if mixed(from, until) {
			fl.mixedMax = max(fl.mixedMax, n)
			if n > mixedBound {
				ev(from, until, "fleet limit", fmt.Sprintf("%d admissions surely within %v near a failure of the single Redis (bound %d)", n, until-from, mixedBound))
			}
			return
		}
		fl.exactMax = max(fl.exactMax, n)
		if n > flRateN {
			ev(from, until, "fleet limit", fmt.Sprintf("%d admissions surely within %v (limit %d per %v)", n, until-from, flRateN, w))
		}
	})
}

// flExcuse: the documented exceptions of the tier's events.
func (s *soak) flExcuse(e event) string {
	switch e.what {
	case "local limit after a restart empty":
		return exFlHeartbeats
	case "local limit, Redis back empty":
		return exSingleEmpty
	case "fleet limit":
		return s.win.excuse(e.at, e.until, "ratelimit") // restarted empty: Redis's window is gone
	}
	return ""
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
	return fmt.Sprintf("%d admissions, %d slow answers (maybe local); %d outages of the single Redis (%d spans of failures): busiest window while unreachable %d (bound %d, +%d into the return second), %d windows checked; near failures %d (bound %d); elsewhere %d (limit %d); %d outages long enough for the never-none check",
		len(fl.adm), len(fl.localSeen), full, len(fl.spans), fl.coreMax, flShare*flInstances, flReturnSlack, fl.coreChecked,
		fl.mixedMax, flRateN+flShare*flInstances-flShare, fl.exactMax, flRateN, fl.noneChecked)
}

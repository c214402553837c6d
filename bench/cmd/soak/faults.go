package main

// The fault schedule: drawn from the seed before the run starts (so a seed
// replays it), one fault at a time with random gaps, then executed against
// the real processes and proxies.

import (
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-dlm/redisdlm/bench/internal/faultproxy"
)

const (
	fPause     = "SIGSTOP/SIGCONT a Redis"
	fRestart   = "kill -9 a Redis, restart empty"
	fLatency   = "latency Caddy→Redis"
	fBlackhole = "blackhole Caddy↔Redis"
	fReset     = "reset connections"
	fKillCaddy = "kill -9 a Caddy, restart"
	fReload    = "reload a Caddy (POST /load)"
	fCancel    = "clients cancel while waiting"
	fStall     = "upstream stalls past the ttl"
	// Two faults at once, the edges of fail_local (faillocal.go): during an
	// outage of the single Redis (SIGSTOP), a Caddy reloads, or the Redis
	// is killed and restarted empty.
	fPauseReload  = "SIGSTOP the single Redis, reload a Caddy meanwhile"
	fPauseRestart = "SIGSTOP the single Redis, kill -9 it meanwhile, restart empty"
)

var faultKinds = []string{fPause, fRestart, fLatency, fBlackhole, fReset, fKillCaddy, fReload, fCancel, fStall, fPauseCaddy, fPauseReload, fPauseRestart}

// Documented exceptions (README "How we test"): what happens inside their
// windows is counted apart, by name.
const (
	exSingleEmpty  = "single Redis restarted empty (no persistence) drops held leases and rate windows"
	exRedlockEmpty = "Redlock member restarted empty within the ttl"
)

type fault struct {
	at     time.Duration // offset from the start of the fault phase
	began  time.Duration // soak clock when it was carried out
	kind   string
	redis  int           // 0 single, 1-3 Redlock members
	caddy  int           // -1 = every Caddy (proxy faults)
	dur    time.Duration // how long it lasts
	amount time.Duration // latency added
}

func (f fault) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%6.1fs", f.at.Seconds())
	if f.began > 0 {
		fmt.Fprintf(&b, " (soak clock %.3fs)", f.began.Seconds())
	}
	fmt.Fprintf(&b, " %s", f.kind)
	switch f.kind {
	case fPauseReload:
		fmt.Fprintf(&b, " caddy%d", f.caddy)
	case fPause, fRestart, fLatency, fBlackhole, fReset:
		fmt.Fprintf(&b, " %s", redisNames[f.redis])
		if f.kind != fPause && f.kind != fRestart {
			if f.caddy < 0 {
				b.WriteString(" from every Caddy")
			} else {
				fmt.Fprintf(&b, " from caddy%d", f.caddy)
			}
		}
	case fKillCaddy, fReload, fPauseCaddy:
		fmt.Fprintf(&b, " caddy%d", f.caddy)
	}
	if f.amount > 0 {
		fmt.Fprintf(&b, " +%v", f.amount)
	}
	if f.dur > 0 {
		fmt.Fprintf(&b, " for %v", f.dur)
	}
	return b.String()
}

var redisNames = []string{"single", "redlock1", "redlock2", "redlock3"}

func randDur(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return (lo + time.Duration(rng.Int63n(int64(hi-lo)+1))).Round(time.Millisecond)
}

// schedule draws faults until the phase of length total is full.
// kinds limits the draw to some kinds (for a focused reproduction).
func schedule(seed int64, total time.Duration, kinds []string) []fault {
	rng := rand.New(rand.NewSource(seed))
	var out []fault
	t := randDur(rng, 500*time.Millisecond, 2*time.Second)
	for {
		f := fault{at: t, kind: kinds[rng.Intn(len(kinds))], redis: rng.Intn(4), caddy: rng.Intn(4)}
		switch f.kind {
		case fPause:
			f.dur = randDur(rng, 200*time.Millisecond, 2*time.Second)
		case fRestart:
			f.dur = randDur(rng, 100*time.Millisecond, time.Second) // down time
		case fLatency:
			f.dur = randDur(rng, 500*time.Millisecond, 3*time.Second)
			f.amount = randDur(rng, 5*time.Millisecond, 200*time.Millisecond)
		case fBlackhole:
			f.dur = randDur(rng, 200*time.Millisecond, 2*time.Second)
		case fReset:
		case fKillCaddy:
			f.dur = randDur(rng, 0, 500*time.Millisecond) // down time before the restart
		case fReload:
		case fCancel:
			f.dur = randDur(rng, 500*time.Millisecond, 2*time.Second)
		case fStall:
			f.dur = randDur(rng, 1500*time.Millisecond, 3*time.Second) // the upstream's hold, ttl is 1s
		case fPauseCaddy:
			f.dur = randDur(rng, 1500*time.Millisecond, 3*time.Second) // past the once route's ttl, 1s
		case fPauseReload, fPauseRestart:
			// Long enough for every instance to be local (a call times out
			// in 300–400 ms) before the reload or the kill, halfway.
			f.dur = randDur(rng, time.Second, 2500*time.Millisecond)
			f.redis = 0
		}
		if f.kind == fLatency || f.kind == fBlackhole || f.kind == fReset {
			if rng.Intn(2) == 0 {
				f.caddy = -1
			}
		}
		// Faults take a little longer than dur to carry out; keep a margin.
		end := t + f.dur + 500*time.Millisecond
		if end > total {
			return out
		}
		out = append(out, f)
		t = end + randDur(rng, 300*time.Millisecond, 3*time.Second)
	}
}

// window is a stretch of the soak clock with a name.
type window struct {
	name     string
	backends []string // which decisions it excuses: "single", "redlock", "ratelimit"
	caddy    int      // transport errors excused for this instance (-1: none)
	from, to time.Duration
}

type windows struct {
	mu sync.Mutex
	ws []window
}

func (w *windows) add(x window) {
	w.mu.Lock()
	w.ws = append(w.ws, x)
	w.mu.Unlock()
}

// excuse names the exception whose window meets [at, until] for backend
// (a rate window that spans a restart empty, say), or "".
func (w *windows) excuse(at, until time.Duration, backend string) string {
	if until < at {
		until = at
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, x := range w.ws {
		if at <= x.to && until >= x.from {
			for _, b := range x.backends {
				if b == backend {
					return x.name
				}
			}
		}
	}
	return ""
}

// caddyDown reports whether instance i was down or reloading at some time
// in [from, to] (transport errors from it are expected then).
func (w *windows) caddyDown(from, to time.Duration, i int) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, x := range w.ws {
		if x.caddy == i && from <= x.to && to >= x.from {
			return true
		}
	}
	return false
}

// inject carries out f; it returns when the fault is over.
func (s *soak) inject(f fault) error {
	now := s.check.now
	proxies := func() []*faultproxy.Proxy {
		var ps []*faultproxy.Proxy
		for i := range s.caddies {
			if f.caddy < 0 || f.caddy == i {
				ps = append(ps, s.proxies[i][f.redis])
			}
		}
		return ps
	}
	switch f.kind {
	case fPause:
		s.redis[f.redis].signal(syscall.SIGSTOP)
		stopped := now()
		time.Sleep(f.dur)
		s.flFault(f, stopped, now())
		s.redis[f.redis].signal(syscall.SIGCONT)
	case fRestart:
		from := now()
		s.redis[f.redis].kill9()
		gone := now()
		time.Sleep(f.dur)
		s.flFault(f, gone, now()) // it may answer as soon as it starts
		if err := s.redis[f.redis].start(); err != nil {
			return err
		}
		s.restartedEmpty(f.redis, from, now())
	case fLatency:
		from := now()
		for _, p := range proxies() {
			p.SetLatency(f.amount)
		}
		time.Sleep(f.dur)
		for _, p := range proxies() {
			p.SetLatency(0)
		}
		s.flFault(f, from, now())
	case fBlackhole:
		for _, p := range proxies() {
			p.SetBlackhole(true)
		}
		holed := now()
		time.Sleep(f.dur)
		s.flFault(f, holed, now())
		for _, p := range proxies() {
			p.SetBlackhole(false)
		}
	case fReset:
		from := now()
		for _, p := range proxies() {
			p.Reset()
		}
		s.flFault(f, from, now())
	case fPauseReload:
		s.redis[0].signal(syscall.SIGSTOP)
		stopped := now()
		time.Sleep(f.dur / 2)
		c := s.caddies[f.caddy]
		from := now()
		err := c.reload(s, 1-c.variant)
		s.win.add(window{name: "caddy reload", caddy: f.caddy, from: from, to: now() + time.Second})
		time.Sleep(max(0, f.dur-(now()-stopped))) // the reload may take a while
		s.flFault(f, stopped, now())
		s.redis[0].signal(syscall.SIGCONT)
		if err != nil {
			return err
		}
	case fPauseRestart:
		s.redis[0].signal(syscall.SIGSTOP)
		stopped := now()
		time.Sleep(f.dur / 2)
		from := now()
		s.redis[0].kill9()
		time.Sleep(f.dur / 2)
		s.flFault(f, stopped, now()) // it may answer as soon as it starts
		if err := s.redis[0].start(); err != nil {
			return err
		}
		s.restartedEmpty(0, from, now())
	case fKillCaddy:
		c := s.caddies[f.caddy]
		from := now()
		c.kill9()
		time.Sleep(f.dur)
		err := c.start(s)
		s.win.add(window{name: "caddy down", caddy: f.caddy, from: from, to: now() + 500*time.Millisecond})
		if err != nil {
			return err
		}
	case fReload:
		c := s.caddies[f.caddy]
		from := now()
		err := c.reload(s, 1-c.variant)
		s.win.add(window{name: "caddy reload", caddy: f.caddy, from: from, to: now() + time.Second})
		if err != nil {
			return err
		}
	case fCancel:
		s.cancelers(f.dur)
	case fStall:
		s.stall(f.dur)
	case fPauseCaddy:
		s.pauseCaddy(f.caddy, f.dur)
	}
	return nil
}

// restartedEmpty adds the documented exceptions of Redis r killed at from
// and up again, empty, at up. (The fail_local tier has none: its instances
// charge their windows again, faillocal.go.)
func (s *soak) restartedEmpty(r int, from, up time.Duration) {
	if r != 0 {
		s.win.add(window{name: exRedlockEmpty, backends: []string{"redlock"}, caddy: -1, from: from, to: up + s.maxTTL + time.Second})
		return
	}
	s.win.add(window{name: exSingleEmpty, backends: []string{"single"}, caddy: -1, from: from, to: up + s.maxTTL + time.Second})
	s.win.add(window{name: exSingleEmpty, backends: []string{"ratelimit"}, caddy: -1, from: from, to: up + rateWindow + 100*time.Millisecond})
	// Orders whose attempts meet the restart lost their run records.
	s.win.add(window{name: exOnceEmpty, backends: []string{"once"}, caddy: -1, from: from - onceSpan, to: up + onceSpan})
}

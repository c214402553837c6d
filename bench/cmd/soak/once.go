package main

// The execute-once tier (docs/execute-once.md "Never twice"): every Caddy
// has a route /once/<key> with `redis_lock { replay 30s }` (POST, an
// unsafe method) on the single Redis, its ttl the stall route's (1s), in
// front of the checker. Clients place "orders": a first POST of a new key
// on a random instance, then one to three retries of it on random
// instances, some while the first still runs. The checker counts the runs
// of each key: a second run of a key is a broken promise. The fault that
// aims at it, "SIGSTOP a Caddy past the ttl", pauses an instance (its
// holders cannot extend their leases) for longer than the ttl while the
// others retry; a Caddy killed with its holders inside is the crash.
//
// Documented exceptions: a single Redis restarted empty loses the run
// records (covered only with persistence and sync_replicas), so a key
// whose attempts meet that restart is counted apart. On the lock routes,
// a holder of a paused Caddy stays inside the upstream past its lease
// while the next holder enters: the overlap a lease cannot prevent, which
// fencing tokens (and the fencing tier, which refuses the late write)
// exist for; counted apart when every holder inside was on a Caddy paused
// since before the newcomer entered.

import (
	"context"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	fPauseCaddy = "SIGSTOP a Caddy past the ttl"
	exOnceEmpty = "single Redis restarted empty (no persistence) drops the run records of replay"
	exPaused    = "holder on a Caddy paused past its lease: the next holder entered (fencing's case)"
	exPausedOld = "request of a Caddy paused past its lease reached the upstream after the next holder's (a stale writer with the lower token)"
	// onceSpan bounds the attempts of one key: the first, its retries
	// after up to 1.5s, each waiting up to 3s for the lock, and the hold.
	onceSpan = 8 * time.Second
)

// onceRoute is the execute-once route of instance c.
func (s *soak) onceRoute(ttl, timeout, redis string) string {
	replay := "replay 30s"
	if *noReplay {
		replay = "# no replay (-no-replay)"
	}
	return fmt.Sprintf("\thandle /once/* {\n\t\tredis_lock {\n\t\t\t%s\n\t\t\tttl %s\n\t\t\twait 3s\n\t\t\ttimeout %s\n\t\t\tredis %s\n\t\t}\n\t\treverse_proxy %s\n\t}\n",
		replay, ttl, timeout, redis, s.check.url)
}

// onceState is the checker's view of the execute-once tier.
type onceState struct {
	runs     map[string]int // key → runs seen
	answers  map[int]int    // status → answers to the clients
	replayed int
}

// onceRun counts a run of key at the upstream; the caller holds c.mu.
func (c *checker) onceRun(key, inst string) {
	if c.once.runs == nil {
		c.once.runs = map[string]int{}
	}
	if c.once.runs[key]++; c.once.runs[key] > 1 {
		c.events = append(c.events, event{at: c.now(), what: "run twice", backend: "once", key: key,
			detail: fmt.Sprintf("run %d of the key, through caddy%s", c.once.runs[key], inst)})
	}
}

// orders numbers the orders of the whole run (warm-up included).
var orders atomic.Int64

// onceWork places orders until stop: a key of its own each time.
func (s *soak) onceWork(id int, stop time.Time) {
	rng := rand.New(rand.NewSource(s.seed*1000 + 900 + int64(id)))
	for time.Now().Before(stop) {
		path := fmt.Sprintf("/once/o%d", orders.Add(1))
		// Long enough for a pause to catch many a run inside.
		hold := time.Duration(100+rng.Intn(500)) * time.Millisecond
		var wg sync.WaitGroup
		wg.Add(1)
		go func(inst int) { defer wg.Done(); s.orderOnce(inst, path, hold) }(rng.Intn(len(s.caddies)))
		for r := 0; r < 1+rng.Intn(3); r++ {
			time.Sleep(time.Duration(rng.Intn(500)) * time.Millisecond)
			wg.Add(1)
			go func(inst int) { defer wg.Done(); s.orderOnce(inst, path, hold) }(rng.Intn(len(s.caddies)))
		}
		wg.Wait()
	}
}

// orderOnce POSTs one attempt of an order and checks its answer: the
// order (first run or replayed), 409 (its run in doubt), 423 (the wait ran
// out), 503 (Redis unreachable, a lost lease, an answer withheld).
func (s *soak) orderOnce(inst int, path string, hold time.Duration) {
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, s.caddies[inst].url()+path, strings.NewReader("order"))
	req.Header.Set("X-Hold", hold.String())
	req.Header.Set("X-Sent", fmt.Sprint(time.Now().UnixMicro()))
	from := s.check.now()
	resp, err := httpClient.Do(req)
	to := s.check.now()
	t := s.tally
	if err != nil {
		t.mu.Lock()
		t.requests["once"]++
		t.tErrs = append(t.tErrs, transportErr{inst: inst, from: from, to: to, err: err.Error()})
		t.mu.Unlock()
		return
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	code, ra := resp.StatusCode, resp.Header.Get("Retry-After")
	s.check.mu.Lock()
	if s.check.once.answers == nil {
		s.check.once.answers = map[int]int{}
	}
	s.check.once.answers[code]++
	if resp.Header.Get("Idempotent-Replayed") == "true" {
		s.check.once.replayed++
	}
	s.check.mu.Unlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.requests["once"]++
	t.statuses[code]++
	t.lat = append(t.lat, to-from)
	sample := fmt.Sprintf("%.3fs caddy%d POST %s → %d (Retry-After %q)", from.Seconds(), inst, path, code, ra)
	switch code {
	case 200, 503:
	case 409, 423:
		var n int
		if _, err := fmt.Sscan(ra, &n); err != nil || n < 1 {
			t.unexpected(fmt.Sprintf("%d on /once/ without Retry-After ≥ 1", code), sample)
		}
	default:
		t.unexpected(fmt.Sprintf("%d on /once/", code), sample)
	}
}

// pauseCaddy stops instance i for d (its holders cannot extend), then
// resumes it.
func (s *soak) pauseCaddy(i int, d time.Duration) {
	c := s.caddies[i]
	c.mu.Lock()
	p := c.cmd.Process
	c.mu.Unlock()
	from := s.check.now()
	p.Signal(syscall.SIGSTOP)
	time.Sleep(d)
	p.Signal(syscall.SIGCONT)
	s.win.add(window{name: "caddy paused", caddy: i, from: from, to: s.check.now()})
}

// pausedExcuse names exPaused for an overlap whose every holder inside
// was on a Caddy paused at some time between its entry and the
// newcomer's, and exPausedOld for a token below an earlier one's carried
// by a request whose Caddy was paused within the 10s before it entered.
func (s *soak) pausedExcuse(e event) string {
	s.win.mu.Lock()
	defer s.win.mu.Unlock()
	if e.what == "token" {
		for _, x := range s.win.ws {
			if e.me != nil && x.name == "caddy paused" && fmt.Sprint(x.caddy) == e.me.inst && x.from <= e.at && x.to >= e.at-10*time.Second {
				return exPausedOld
			}
		}
		return ""
	}
	if len(e.inside) == 0 {
		return ""
	}
	for _, h := range e.inside {
		paused := false
		for _, x := range s.win.ws {
			if x.name == "caddy paused" && fmt.Sprint(x.caddy) == h.inst && x.from <= e.at && x.to >= h.entry {
				paused = true
			}
		}
		if !paused {
			return ""
		}
	}
	return exPaused
}

// onceSummary is the tier's line of the report.
func (s *soak) onceSummary() string {
	s.check.mu.Lock()
	defer s.check.mu.Unlock()
	keys, runs := len(s.check.once.runs), 0
	for _, n := range s.check.once.runs {
		runs += n
	}
	return fmt.Sprintf("%d keys, %d runs at the upstream, answers %s, %d replayed", keys, runs,
		counted(s.check.once.answers, func(c int) string { return fmt.Sprint(c) }), s.check.once.replayed)
}

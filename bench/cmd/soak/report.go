package main

// Afterwards: leftovers in Redis, connections and goroutines against the
// baseline, the checker's events by exception, and the summary table.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

func getStatus(ctx context.Context, url string) (int, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("X-Sent", strconv.FormatInt(time.Now().UnixMicro(), 10))
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

func redisClient(r *redisProc) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: r.addr(), MaxRetries: -1, PoolSize: 1})
}

// snapshot is what should come back to where it started.
type snapshot struct {
	conns []int // connected_clients per Redis (this one's own connection included)
	goros []int // go_goroutines per Caddy
}

// measure closes idle HTTP connections on both sides of Caddy first, so
// that only what the plugin keeps is counted.
func (s *soak) measure() (snapshot, error) {
	transport.CloseIdleConnections()
	s.check.flushConns()
	time.Sleep(700 * time.Millisecond)
	var sn snapshot
	for _, r := range s.redis {
		c := redisClient(r)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		info, err := c.Info(ctx, "clients").Result()
		cancel()
		c.Close()
		if err != nil {
			return sn, fmt.Errorf("%s INFO clients: %w", r.name, err)
		}
		n := -1
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "connected_clients:"); ok {
				n, _ = strconv.Atoi(v)
			}
		}
		sn.conns = append(sn.conns, n)
	}
	for _, c := range s.caddies {
		n, err := c.goroutines()
		if err != nil {
			return sn, err
		}
		sn.goros = append(sn.goros, n)
	}
	return sn, nil
}

// leftovers lists lock keys still held (a holder set with members) and
// keys of the plugin without an expiry, on every server.
func (s *soak) leftovers() (held, noTTL []string, err error) {
	for _, r := range s.redis {
		c := redisClient(r)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		keys, e := c.Keys(ctx, "caddy:*").Result() // a few hundred keys at most
		if e != nil {
			cancel()
			c.Close()
			return nil, nil, fmt.Errorf("%s KEYS: %w", r.name, e)
		}
		for _, k := range keys {
			if strings.HasPrefix(k, "caddy:lock:") && !strings.HasSuffix(k, ":waitq") && !strings.HasSuffix(k, ":dead") && c.Type(ctx, k).Val() == "zset" {
				if n := c.ZCard(ctx, k).Val(); n > 0 {
					held = append(held, fmt.Sprintf("%s %s (%d)", r.name, k, n))
				}
			}
			if c.PTTL(ctx, k).Val() == -1 { // go-redis keeps -1 (no expiry) as is
				noTTL = append(noTTL, r.name+" "+k)
			}
		}
		cancel()
		c.Close()
	}
	return held, noTTL, nil
}

// counted sorts a tally into "k: n" items.
func counted[K comparable](m map[K]int, name func(K) string) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, fmt.Sprintf("%s: %d", name(k), v))
	}
	sort.Strings(parts)
	if len(parts) == 0 {
		return "0"
	}
	return strings.Join(parts, ", ")
}

// connDrift names the Redis servers whose connected_clients grew by more
// than conn-slack per Caddy from base to end.
func (s *soak) connDrift(base, end snapshot) []string {
	var drift []string
	for i := range s.redis {
		if end.conns[i] > base.conns[i]+*connSlack*len(s.caddies) {
			drift = append(drift, fmt.Sprintf("%s connections %d → %d", redisNames[i], base.conns[i], end.conns[i]))
		}
	}
	return drift
}

func (s *soak) report(plan []fault, faults map[string]int, base, end snapshot, probes, held, noTTL []string) error {
	t := s.tally
	checked, tightest := s.check.rateEvents(rateN, rateWindow)
	apparent, tightestUp := s.check.apparentRate(rateN, rateWindow, *tolerance)
	s.flCheck()

	// Checker events: excused by name, or failures.
	type kind struct{ what, excuse string }
	evs := map[kind]int{}
	var failures []string
	var samples []string
	for _, e := range s.check.events {
		k := kind{what: e.what}
		switch e.what {
		case "overlap":
			k.excuse = overlapExcuse(e) // the most specific name first
			if k.excuse == "" {
				k.excuse = s.pausedExcuse(e)
			}
		case "token":
			// The lock issued the tokens in order; a late zombie request
			// carries the older one, and fencing is what refuses it.
			k.excuse = staleExcuse(e)
			if k.excuse == "" {
				k.excuse = s.pausedExcuse(e)
			}
		case "write out of token order":
			k.excuse = exReordered
		}
		if k.excuse == "" && e.what != "token" { // tokens increase across every fault, restarts included
			k.excuse = s.win.excuse(e.at, e.until, e.backend)
		}
		evs[k]++
		if k.excuse == "" {
			failures = append(failures, e.what)
			if len(samples) < 20 {
				samples = append(samples, fmt.Sprintf("%.3fs %s %s: %s", e.at.Seconds(), e.what, e.key, e.describe()))
			}
		}
	}
	line := func(what string) string {
		n, apart := evs[kind{what: what}], map[string]int{}
		for k, v := range evs {
			if k.what == what && k.excuse != "" {
				apart[k.excuse] += v
			}
		}
		out := strconv.Itoa(n)
		if len(apart) > 0 {
			out += " (apart, documented: " + counted(apart, func(s string) string { return s }) + ")"
		}
		return out
	}

	// Transport errors: expected from an instance that was down or reloading.
	tExpected, tBad := 0, map[string]int{}
	for _, e := range t.tErrs {
		if s.win.caddyDown(e.from, e.to, e.inst) {
			tExpected++
			continue
		}
		tBad["transport error"]++
		if len(samples) < 20 {
			samples = append(samples, fmt.Sprintf("%.3fs caddy%d: %s", e.from.Seconds(), e.inst, e.err))
		}
	}
	for k, v := range tBad {
		t.bad[k] += v
	}
	for k := range t.bad {
		failures = append(failures, k)
	}
	samples = append(samples, t.badSamples...)

	// Leftovers and the baseline.
	drift := s.connDrift(base, end)
	for i := range s.caddies {
		if end.goros[i] > base.goros[i]+*goroSlack {
			drift = append(drift, fmt.Sprintf("caddy%d goroutines %d → %d", i, base.goros[i], end.goros[i]))
		}
	}
	if len(held) > 0 {
		failures = append(failures, "lock keys still held")
	}
	if len(noTTL) > 0 {
		failures = append(failures, "keys without expiry")
	}
	if len(drift) > 0 {
		failures = append(failures, "connections or goroutines not back")
	}
	if len(probes) > 0 {
		failures = append(failures, "routes not back to 200")
	}
	if len(s.check.fl.adm) == 0 {
		failures = append(failures, "the fail_local route admitted nothing")
	}
	if len(s.check.once.runs) == 0 {
		failures = append(failures, "the execute-once route ran nothing")
	}
	if s.check.fenceVacuous() {
		failures = append(failures, "the fence refused none of the late writes")
	}

	total := 0
	for _, n := range t.requests {
		total += n
	}
	pair := func(a, b []int) string {
		var parts []string
		for i := range a {
			parts = append(parts, fmt.Sprintf("%d→%d", a[i], b[i]))
		}
		return strings.Join(parts, ", ")
	}
	verdict := "PASS"
	if len(failures) > 0 {
		verdict = "FAIL"
	}
	row := func(k, v string) { fmt.Printf("| %s | %s |\n", k, v) }
	fmt.Printf("\n### Soak: seed %d, %v of faults, %s\n\n", s.seed, *duration, time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Println("| | |")
	fmt.Println("|---|---|")
	row("result", verdict)
	row("replay", fmt.Sprintf("`make soak SOAK=%v SEED=%d`", *duration, s.seed))
	row("requests", fmt.Sprintf("%d (%s)", total, counted(t.requests, func(r string) string { return "/" + r + "/" })))
	row("faults", fmt.Sprintf("%d (%s)", len(plan), counted(faults, func(k string) string { return k })))
	row("overlaps", line("overlap"))
	row("token violations", line("token"))
	row("limit violations", fmt.Sprintf("%s (%d admissions checked against `rate %d %v`; tightest proven span of %d: %v)",
		line("rate"), checked, rateN, rateWindow, rateN+1, tightest))
	row("limit, upstream clock (transit noise, not failed)", fmt.Sprintf("%d windows with %d arrivals within %v − %v; tightest %v",
		apparent, rateN+1, rateWindow, *tolerance, tightestUp.Round(time.Microsecond)))
	row("stale writes stored (fencing tier)", line("stale write stored"))
	row("stored writes out of token order", line("write out of token order"))
	row("fenced writes", s.check.fenceSummary())
	row("unexpected fence answers", line("unexpected fence answer"))
	row("fail_local: bound Σ max(through Redis, share) broken near an outage", line("local limit"))
	row("fail_local: none admitted for a window while Redis was unreachable", line("none admitted"))
	row("fail_local: more than n decided by Redis, near a partial failure more than n + (N−1)·share, elsewhere more than n", line("fleet limit"))
	row("fail_local tier (/fl/)", s.flSummary())
	row("execute once: a key run twice (/once/)", line("run twice"))
	row("execute-once tier (/once/)", s.onceSummary())
	row("bad requests served", line("bad request served"))
	row("statuses", counted(t.statuses, strconv.Itoa))
	row("client cancels (Caddy logs 499)", strconv.Itoa(t.canceled))
	row("transport errors while the Caddy was down or reloading", strconv.Itoa(tExpected))
	row("unexpected answers", counted(t.bad, func(k string) string { return k }))
	row("latency p50 / p99 (all answers)", fmt.Sprintf("%v / %v", pct(t.lat, 0.5).Round(10*time.Microsecond), pct(t.lat, 0.99).Round(10*time.Microsecond)))
	row("lock keys held afterwards", strconv.Itoa(len(held)))
	row("plugin keys without expiry", strconv.Itoa(len(noTTL)))
	row("Redis connections before → after (single, redlock1-3)", pair(base.conns, end.conns))
	row("Caddy goroutines before → after", pair(base.goros, end.goros))
	row("routes answering 200 again", fmt.Sprintf("%s", joinOr(probes, "all")))
	if len(samples)+len(held)+len(noTTL)+len(drift) > 0 {
		fmt.Println()
		for _, x := range append(append(append(samples, held...), noTTL...), drift...) {
			fmt.Println("- " + x)
		}
	}
	fmt.Println()
	fmt.Fprintln(os.Stderr, "fault schedule:")
	for _, f := range plan {
		fmt.Fprintln(os.Stderr, "  "+f.String())
	}
	if *keepDir {
		var b strings.Builder
		for _, e := range s.check.events {
			fmt.Fprintf(&b, "%.6f %s [%s|%s] %s: %s\n", e.at.Seconds(), e.what, s.win.excuse(e.at, e.until, e.backend), overlapExcuse(e), e.key, e.describe())
		}
		os.WriteFile(filepath.Join(workDir, "events.txt"), []byte(b.String()), 0o644)
		os.WriteFile(filepath.Join(workDir, "admissions.txt"), []byte(strings.Join(s.check.rlLog, "\n")), 0o644)
	}
	if len(failures) > 0 {
		return fmt.Errorf("FAIL (seed %d): %s", s.seed, strings.Join(uniq(failures), ", "))
	}
	return nil
}

func uniq(xs []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, x := range xs {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

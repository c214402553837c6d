package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

func check(ok bool) string {
	if ok {
		return "✔"
	}
	return "✘"
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "?"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "model name") {
			if _, v, ok := strings.Cut(l, ":"); ok {
				return strings.TrimSpace(v)
			}
		}
	}
	return "?"
}

func redisVersion(addr string) string {
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	info, err := c.Info(context.Background(), "server").Result()
	if err != nil {
		return "?"
	}
	for _, l := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "redis_version:"); ok {
			return v
		}
	}
	return "?"
}

func caddyVersion() string {
	out, err := exec.Command(*caddyBin, "version").Output()
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(out))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}

func printReport(e *env, hot []hotResult, cmds []cmdRow, seq []seqResult, rl *rlResult, took time.Duration) {
	w := os.Stdout
	p := func(f string, a ...any) { fmt.Fprintf(w, f+"\n", a...) }

	p("## Benchmark (`make bench`)")
	p("")
	la := strings.Fields(string(loadAvg))
	if len(la) > 3 {
		la = la[:3]
	}
	p("%s · %d × %s (nproc %d) · load average at start %s · %s %s/%s · Redis %s · Caddy %s with this plugin · run took %.0f s",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), cpuModel(), runtime.NumCPU(), strings.Join(la, " "),
		runtime.Version(), runtime.GOOS, runtime.GOARCH, redisVersion(e.r1.addr()), caddyVersion(), took.Seconds())
	p("")

	// Hot key.
	p("### Hot key: one key, %s upstream, %s warm-up + %s measured", *hold, *warmup, *measure)
	p("")
	p("| contender | clients | utilisation | goal | served/s | per client min / max | hand-off p50 / p99 | errors | exclusive · fencing |")
	p("|---|---|---|---|---|---|---|---|---|")
	for _, r := range hot {
		if r.err != nil {
			p("| %s | %s | — | — | — | — | — | %s: %v | — |", r.who, r.clients, r.errs, r.err)
			continue
		}
		goal := "—"
		if r.goal > 0 {
			goal = fmt.Sprintf("≥ %.2f %s", r.goal, check(r.util >= r.goal))
		}
		starve := ""
		if r.starved > 0 {
			starve = fmt.Sprintf(" ✘ %d starved", r.starved)
		} else if r.goal > 0 {
			starve = " ✔"
		}
		excl := fmt.Sprintf("max in-flight %d %s", 1+boolInt(r.overlap > 0), check(r.overlap == 0))
		if r.overlap > 0 {
			excl = fmt.Sprintf("%d overlapping ✘", r.overlap)
		}
		fence := "no token"
		if r.fenceSeen > 0 {
			fence = fmt.Sprintf("tokens increase %s", check(r.fenceBad == 0))
			if r.fenceBad > 0 {
				fence = fmt.Sprintf("%d tokens out of order ✘", r.fenceBad)
			}
		}
		p("| %s | %s | **%.2f** | %s | %.0f | %d / %d%s | %s / %s | %s | %s · %s |",
			r.who, r.clients, r.util, goal, r.served, r.minC, r.maxC, starve,
			ms(pct(r.gapAll, 0.5)), ms(pct(r.gapAll, 0.99)), r.errs, excl, fence)
	}
	p("")

	// Hand-off.
	p("### Hand-off latency: one request's exit from the upstream → the next one's entry")
	p("")
	p("| run | same instance p50 / p99 (n) | across instances p50 / p99 (n) | hand-offs across | served per instance |")
	p("|---|---|---|---|---|")
	for _, r := range hot {
		if r.err != nil || !strings.HasPrefix(r.name, "hot-caddy") && r.name != "hot-ceiling" {
			continue
		}
		same, across := "—", "—"
		if len(r.gapSame) > 0 {
			same = fmt.Sprintf("%s / %s (%d)", ms(pct(r.gapSame, 0.5)), ms(pct(r.gapSame, 0.99)), len(r.gapSame))
		}
		if len(r.gapAcross) > 0 {
			across = fmt.Sprintf("%s / %s (%d)", ms(pct(r.gapAcross, 0.5)), ms(pct(r.gapAcross, 0.99)), len(r.gapAcross))
		}
		var parts []string
		for _, k := range []string{"a", "b"} {
			if n, ok := r.perInstance[k]; ok {
				parts = append(parts, fmt.Sprintf("%s: %d", k, n))
			}
		}
		p("| %s | %s | %s | %.0f%% | %s |", r.who, same, across,
			100*float64(len(r.gapAcross))/float64(max(1, len(r.gapAll))), strings.Join(parts, ", "))
	}
	if r := refResult; r.err == nil && len(r.gapAll) > 0 {
		p("| %s | %s / %s (%d) | — | — | utilisation %.2f |", r.who, ms(pct(r.gapAll, 0.5)), ms(pct(r.gapAll, 0.99)), len(r.gapAll), r.util)
	}
	p("")

	// Commands.
	p("### Redis commands sent by Caddy (MONITOR, top-level commands only)")
	p("")
	p("| run | requests | commands | per request | goal | by command |")
	p("|---|---|---|---|---|---|")
	for _, c := range cmds {
		if c.err != nil && c.reqs == 0 {
			p("| %s | — | — | — | — | error: %s |", c.what, oneLine(c.err))
			continue
		}
		per := float64(c.cmds) / float64(max(1, c.reqs))
		goal := "—"
		if c.goal > 0 {
			goal = fmt.Sprintf("≤ %.0f %s", c.goal, check(per <= c.goal+1e-9))
		}
		p("| %s | %d | %d | **%.2f** per %s | %s | %s |", c.what, c.reqs, c.cmds, per, c.unit, goal, c.breakdown)
	}
	p("")

	// Redlock.
	p("### Lock latency, uncontended (sequential requests on distinct keys, `redis_lock` + `respond`)")
	p("")
	p("| config | median | p99 | n | median ÷ 1 server | lock's own share ÷ 1 server's | goal |")
	p("|---|---|---|---|---|---|---|")
	var base, one, ping time.Duration
	for _, s := range seq {
		switch s.name {
		case "Caddy, `respond` only (base)":
			base = s.median
		case "redis_lock, 1 server":
			one = s.median
		case pingRow:
			ping = s.median
		}
	}
	for _, s := range seq {
		if s.err != nil {
			p("| %s | — | — | — | — | — | error: %s |", s.name, oneLine(s.err))
			continue
		}
		ratio, share, goal := "—", "—", "—"
		if strings.Contains(s.name, "3 servers") && one > 0 {
			ratio = fmt.Sprintf("%.2f", float64(s.median)/float64(one))
			if one > base {
				sh := float64(s.median-base) / float64(one-base)
				share = fmt.Sprintf("**%.2f**", sh)
				if !strings.Contains(s.name, "paused") {
					goal = "note only: see the latency-proxy figure"
				}
			}
		}
		if s.name == "redis_lock, 1 server" {
			ratio, share = "1.00", "1.00"
		}
		errs := ""
		if es := s.errs.String(); es != "0" {
			errs = " (non-200: " + es + ")"
		}
		p("| %s | %s | %s | %d%s | %s | %s | %s |", s.name, ms(s.median), ms(s.p99), s.n, errs, ratio, share, goal)
	}
	p("")
	if ping > 0 && one > 0 && base > 0 {
		added := float64(one-base) / float64(ping)
		p("Uncontended lock's added latency, (1 server − `respond` only) medians ÷ one PING's median: **%.2f** (goal ≤ 1.6 %s; exactly one Redis round trip on the client's path scores 1.05–1.5 here).", added, check(added <= 1.6))
		p("")
	}

	printRateLimit(p, rl)

	p("Notes:")
	p("- Utilisation = Σ(exit − entry) of the upstream's own requests ÷ (last exit − first entry), over requests that entered in the measured window; the upstream sleeps %s, and a sleep that really takes longer counts fully as busy. It also checks that at most one request is inside at a time and that `Lock-Fencing-Token` strictly increases.", *hold)
	p("- Caddy rows: each HTTP client (keep-alive) sends its next request as soon as it has read the response; Caddy's `redis_lock` (key `{http.request.uri.path}`, defaults otherwise) wraps `request_header X-Instance` + `reverse_proxy` to the upstream. Two-Caddy rows: two processes, one Redis, %d clients each.", *clients/2)
	p("- Ceiling row: the same %d clients, upstream and Caddy config as the 1-Caddy row, but `bench_mutex` (bench/benchmutex, built into bin/caddy-ceiling: one process-wide sync.Mutex — FIFO hand-off in starvation mode — held around `next`, with an increasing `Lock-Fencing-Token`) instead of `redis_lock`. No Redis and no network hop for the lock: it is the ceiling for this harness; the gap between it and the redis_lock row is what the lock costs, the gap between it and 1.00 is Caddy's reverse_proxy path and the client round trip.", *clients)
	p("- Library rows: %d goroutines in the bench process, each looping acquire → GET the same upstream over HTTP → release → sleep %s (a real hand-off: the releaser does not re-ask at once). The same loop for every library; sync.Mutex is the ceiling of that loop.", *clients, *libPause)
	p("- Hand-off = next request's entry − previous request's exit at the upstream: it includes the response flowing back through Caddy, the release round trip, the wake-up and the next acquire round trip (and, through Caddy, the proxy hop to the upstream). The reference row is one client with no lock: its gap is the upstream → Caddy → client → Caddy → upstream path, more than a lock hand-off needs besides Redis.")
	p("- Commands: a raw MONITOR connection counts every command Caddy's connections sent; lines from inside scripts (`lua`) are left out, so a script call counts once; a new connection's handshake (HELLO, AUTH, CLIENT, INFO, SELECT) is shown but not counted per request. Scripts named by their SHA1. Uncontended rows count every request sent while MONITOR ran (10 unmeasured ones included); contended rows divide by acquisitions that reached the upstream.")
	p("- Latency rows: the three configurations and one PING are sampled round-robin (same machine load), each call after an unmeasured `respond`-only request (so that none overlaps the background release of the call before it), each request on a new path, so a new key; they go through HTTP (client → Caddy → Redis → `respond`), which makes the plain ratio look better; \"lock's own share\" = (median − base) ÷ (1-server median − base), base = the same Caddy with `respond` only. The Redlock row runs in a third Caddy process on three redis-servers; the paused row SIGSTOPs one of them (budget %s).", 8*time.Second)
	p("- 2 cores shared by Redis, Caddy, the driver and the upstream: figures move by a few per cent between runs.")
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func oneLine(err error) string {
	s := strings.ReplaceAll(err.Error(), "\n", " ")
	s = strings.ReplaceAll(s, "|", "/")
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}

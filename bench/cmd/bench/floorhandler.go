package main

// The floor handlers, for scale beside the cost goals: the least a
// Redis-backed lock and a Redis-backed rate limit can do per request inside
// Caddy (bench/benchfloor, built into bin/caddy-ceiling), measured in the
// same rounds as redis_lock and redis_ratelimit, on the same Redis
// servers, each against its own Caddy's `respond` site. What one of the
// plugin's ratios would be if its handler did nothing but the floor's
// Redis calls through go-redis: a goal that this floor misses on the
// machine is out of reach of any handler that makes its Redis calls one
// request at a time.

import (
	"fmt"
	"os"
)

// floorSites: the ceiling binary's `respond` site, and each floor handler
// + `respond` (the lock's key = the path, the rate limit's = the X-Key
// field): bench_floor_lock, bench_floor_lock batched,
// bench_floor_ratelimit, bench_floor_ratelimit batched.
func floorSites(plain int, sites [4]int, lockAddr, rlAddr string) string {
	out := respondSite(plain)
	for i, d := range []string{"bench_floor_lock " + lockAddr, "bench_floor_lock batched " + lockAddr, "bench_floor_ratelimit " + rlAddr, "bench_floor_ratelimit batched " + rlAddr} {
		out += fmt.Sprintf("\nhttp://127.0.0.1:%d {\n\t%s\n\trespond \"ok\" 200\n}\n", sites[i], d)
	}
	return out
}

// floorHandlers is the floor handlers' Caddy and its loads (nil loads
// when it could not start: err says why).
type floorHandlers struct {
	err                    error
	plainBase, lockBase    string
	plainL, lockL, lockB   *costLoad // in the lock rounds (lockB: batched)
	plainR, limitL, limitB *costLoad // in the rate-limit rounds (limitB: batched)
}

// startFloorHandlers starts bin/caddy-ceiling with the floor sites.
func startFloorHandlers(lockAddr, rlAddr, tag string, clients, keys int) *floorHandlers {
	f := &floorHandlers{}
	if _, err := os.Stat(*ceilBin); err != nil {
		f.err = fmt.Errorf("the floor handlers' binary: %w (run `make bin/caddy-ceiling`)", err)
		return f
	}
	var plain int
	var sites [4]int
	for _, q := range []*int{&plain, &sites[0], &sites[1], &sites[2], &sites[3]} {
		if *q, f.err = freePort(); f.err != nil {
			return f
		}
	}
	proc, err := startCaddyBin(*ceilBin, "caddyFloor", globalOpts("floor")+floorSites(plain, sites, lockAddr, rlAddr), append([]int{plain}, sites[:]...)...)
	if f.err = err; err != nil {
		return f
	}
	pid := proc.cmd.Process.Pid
	url := func(port int) string { return fmt.Sprintf("http://127.0.0.1:%d", port) }
	load := func(name string, port int, tag string, limited bool) *costLoad {
		return &costLoad{name: name, pid: pid, do: httpLoad(url(port), tag, limited, false, clients, keys)}
	}
	f.plainBase, f.lockBase = url(plain), url(sites[0])
	f.plainL = load("floor handlers' plain (lock rounds)", plain, tag, false)
	f.lockL = load("bench_floor_lock", sites[0], tag+"f", false)
	f.lockB = load("bench_floor_lock batched", sites[1], tag+"b", false)
	f.plainR = load("floor handlers' plain (rate-limit rounds)", plain, tag, false)
	f.limitL = load("bench_floor_ratelimit", sites[2], tag+"f", true)
	f.limitB = load("bench_floor_ratelimit batched", sites[3], tag+"b", true)
	return f
}

// lockLoads and rlLoads are the loads the floor adds to each part's rounds.
func (f *floorHandlers) lockLoads() []*costLoad {
	if f.err != nil {
		return nil
	}
	return []*costLoad{f.plainL, f.lockL, f.lockB}
}

func (f *floorHandlers) rlLoads() []*costLoad {
	if f.err != nil {
		return nil
	}
	return []*costLoad{f.plainR, f.limitL, f.limitB}
}

// latTargets are the floor's sequential latency targets: its plain site
// and bench_floor_lock.
func (f *floorHandlers) latTargets() []latTarget {
	if f.err != nil {
		return nil
	}
	return []latTarget{{name: "floor plain", base: f.plainBase}, {name: "floor locked", base: f.lockBase}}
}

// note puts the plugin's rows beside the floor handlers' same ratios.
func (f *floorHandlers) note(plainL, lockedL, lockFloor *costLoad, seq []seqResult, plainR, swL, gcraL, exactL *costLoad) string {
	if f.err != nil {
		return "✘ the floor handlers (bench/benchfloor): " + oneLine(f.err)
	}
	both := func(what string, floorX, oursX []float64) string {
		return fmt.Sprintf("%s **%.2f** (rounds %s; the plugin's %.2f)", what, median(floorX), roundsText(floorX, "%.2f"), median(oursX))
	}
	lat := func(locked, plain seqResult) float64 {
		ping := seqNamed(seq, "ping")
		return float64(locked.median-plain.median) / float64(max(ping.median, 1))
	}
	latency := "latency —"
	if fl, fp := seqNamed(seq, "floor locked"), seqNamed(seq, "floor plain"); fl.err == nil && fp.err == nil {
		latency = fmt.Sprintf("locked − plain p50 ÷ PING **%.2f** (the plugin's %.2f)", lat(fl, fp), lat(seqNamed(seq, "locked"), seqNamed(seq, "plain")))
	}
	lockPart := fmt.Sprintf("`bench_floor_lock` (`SET key token NX PX 8000` before the route, the owner-checked `DEL` script in a goroutine after it, one go-redis call each, nothing else): %s; %s; %s; %s. Batched (the commands of concurrent requests share pipelines, one worker): %s; %s",
		both("throughput ÷ plain", perRound(f.lockL, f.plainL, tputRatio), perRound(lockedL, plainL, tputRatio)),
		both("Caddy CPU added ÷ plain", perRound(f.lockL, f.plainL, caddyAddedRatio), perRound(lockedL, plainL, caddyAddedRatio)),
		both("Redis CPU ÷ the lock floor", perRound(f.lockL, lockFloor, redisCPURatio), perRound(lockedL, lockFloor, redisCPURatio)),
		latency,
		both("throughput ÷ plain", perRound(f.lockB, f.plainL, tputRatio), perRound(lockedL, plainL, tputRatio)),
		both("Caddy CPU added ÷ plain", perRound(f.lockB, f.plainL, caddyAddedRatio), perRound(lockedL, plainL, caddyAddedRatio)))
	ours := func(f func(a, b costSample) float64) string {
		return fmt.Sprintf("sliding_window %.2f, gcra %.2f", median(perRound(swL, plainR, f)), median(perRound(gcraL, plainR, f)))
	}
	oursRedis := fmt.Sprintf("sliding_window %.2f, gcra %.2f", median(perRound(swL, exactL, redisCPURatio)), median(perRound(gcraL, exactL, redisCPURatio)))
	rl := func(l *costLoad) string {
		t, c, r := perRound(l, f.plainR, tputRatio), perRound(l, f.plainR, caddyAddedRatio), perRound(l, exactL, redisCPURatio)
		return fmt.Sprintf("throughput ÷ plain **%.2f** (rounds %s; the plugin's %s); Caddy CPU added ÷ plain **%.2f** (rounds %s; the plugin's %s); Redis CPU ÷ the exact floor **%.2f** (rounds %s; the plugin's %s)",
			median(t), roundsText(t, "%.2f"), ours(tputRatio), median(c), roundsText(c, "%.2f"), ours(caddyAddedRatio), median(r), roundsText(r, "%.2f"), oursRedis)
	}
	rlPart := fmt.Sprintf("`bench_floor_ratelimit` (one go-redis pipeline of `INCRBY` + `PEXPIRE` per request, Envoy-style, nothing batched across requests, never rejecting): %s. Batched (the exact floor in Caddy: the keys of concurrent requests handed to one worker, one script call per batch doing a `GET` and a `SET … PX` of each, no logic): %s",
		rl(f.limitL), rl(f.limitB))
	return fmt.Sprintf("Floor handlers in Caddy, for scale (not rows of the table; bench/benchfloor in bin/caddy-ceiling, the same Redis servers, each measured in the same rounds against that Caddy's own `respond` site): %s. %s. A goal that a floor handler misses here is out of reach of a handler built its way.", lockPart, rlPart)
}

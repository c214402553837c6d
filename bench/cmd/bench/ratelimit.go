package main

// The redis_ratelimit figures: throughput ÷ the same Caddy with
// `respond` only, Redis commands per request (and 0 for a client in the
// local deny cache), and the decision latency while Redis is paused
// (SIGSTOP) and the circuit breaker is open.

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	rlClients = flag.Int("rl-clients", 64, "rate-limit throughput: concurrent keep-alive clients")
	rlMeasure = flag.Duration("rl-measure", 1500*time.Millisecond, "rate-limit throughput: measured time per target and round")
	rlRounds  = flag.Int("rl-rounds", 8, "rate-limit throughput: rounds (each runs every target once, order rotated)")
	rlKeys    = flag.Int("rl-keys", 64, "rate-limit throughput: keys each client cycles through")
	rlDenyN   = flag.Int("rl-deny", 300, "deny cache: sequential requests on one key with `rate 1 1m`")
)

// rlPorts are the sites of the rate-limit Caddy process.
type rlPorts struct {
	base, sw, gcra, denySW, denyGCRA, pOpen, pClosed int
}

// rlSites: every rate-limited site keys by the X-Key header, so the load
// generator chooses how many keys are used. The limits never reject during
// the throughput run (sliding_window's largest n, gcra's finest rate).
func rlSites(p rlPorts, rAddr, pAddr string) string {
	site := func(port int, body string) string {
		return fmt.Sprintf("\nhttp://127.0.0.1:%d {\n%s\trespond \"ok\" 200\n}\n", port, body)
	}
	rl := func(opts string) string {
		return "\tredis_ratelimit {\n\t\tkey {http.request.header.X-Key}\n" + opts + "\t}\n"
	}
	return site(p.base, "") +
		site(p.sw, rl(fmt.Sprintf("\t\trate 100000 1s\n\t\tredis %s\n", rAddr))) +
		site(p.gcra, rl(fmt.Sprintf("\t\trate 1000000 1s\n\t\talgorithm gcra\n\t\tredis %s\n", rAddr))) +
		site(p.denySW, rl(fmt.Sprintf("\t\trate 1 1m\n\t\tredis %s\n", rAddr))) +
		site(p.denyGCRA, rl(fmt.Sprintf("\t\trate 1 1m\n\t\talgorithm gcra\n\t\tredis %s\n", rAddr))) +
		site(p.pOpen, rl(fmt.Sprintf("\t\trate 100000 1s\n\t\tredis %s\n", pAddr))) +
		site(p.pClosed, rl(fmt.Sprintf("\t\trate 100000 1s\n\t\tfail_closed\n\t\tredis %s\n", pAddr)))
}

// ---- throughput -----------------------------------------------------------------

type tpTarget struct {
	name, url string
	limited   bool // expects RateLimit headers (a decision by Redis)

	reqs    int64         // measured requests (200)
	dur     time.Duration // measured time
	rounds  []float64     // req/s per round
	sent    atomic.Int64  // every request sent, warm-up included
	noHdr   atomic.Int64  // 200 without a RateLimit field: not decided by Redis
	errs    *errCount
	ratioTo []float64  // per round: this ÷ base of the same round
	cpu     [3]float64 // CPU seconds during measured slices: caddy, redis, bench
}

// redisCPU is used_cpu_user + used_cpu_sys from Redis's INFO cpu (the
// server's own CPU time so far, its network system calls included).
func redisCPU(c *redis.Client) float64 {
	info, err := c.Info(context.Background(), "cpu").Result()
	if err != nil {
		return 0
	}
	var sum float64
	for _, line := range strings.Split(info, "\r\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, _ := strconv.ParseFloat(v, 64)
			sum += f
		}
	}
	return sum
}

// cpuSeconds is the user+system CPU time of a process so far.
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		s = s[i+1:]
	}
	f := strings.Fields(s)
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (u + st) / 100 // USER_HZ
}

// closedLoop runs clients goroutines, each sending its next request as soon
// as it has read the answer, for warm + measure; it returns the number of
// 200 answers completed inside the measured part, and for each probe (a CPU
// counter) its growth over exactly that part.
func closedLoop(t *tpTarget, clients int, warm, measure time.Duration, probes ...func() float64) (int64, time.Duration, []float64) {
	start := time.Now()
	from, stop := start.Add(warm), start.Add(warm+measure)
	ctx, cancel := context.WithDeadline(context.Background(), stop.Add(3*time.Second))
	defer cancel()
	var ok atomic.Int64
	var wg sync.WaitGroup
	grew := make([]float64, len(probes))
	if len(probes) > 0 && measure > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Until(from))
			for i, f := range probes {
				grew[i] = -f()
			}
			time.Sleep(time.Until(stop))
			for i, f := range probes {
				grew[i] += f()
			}
		}()
	}
	tag := strconv.FormatInt(start.UnixNano()%1e6, 36)
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			for i := 0; ; i++ {
				now := time.Now()
				if !now.Before(stop) {
					return
				}
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, t.url+"/", nil)
				req.Header.Set("X-Key", fmt.Sprintf("tp-%s-%d-%d", tag, c, i%*rlKeys))
				resp, err := httpClient.Do(req)
				t.sent.Add(1)
				if err != nil {
					if ctx.Err() == nil {
						t.errs.add("transport error")
						time.Sleep(10 * time.Millisecond)
					}
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				done := time.Now()
				if resp.StatusCode != 200 {
					t.errs.add(strconv.Itoa(resp.StatusCode))
					continue
				}
				if t.limited && resp.Header.Get("RateLimit") == "" {
					t.noHdr.Add(1)
				}
				if !done.Before(from) && done.Before(stop) {
					ok.Add(1)
				}
			}
		}(c)
	}
	wg.Wait()
	return ok.Load(), measure, grew
}

// ---- latency --------------------------------------------------------------------

type latRow struct {
	name     string
	url      string
	want     int
	needHdr  bool // a RateLimit field (decided by Redis) expected
	lat      []time.Duration
	bad      *errCount
	slow     int // over 100 ms (a probe waiting for the paused Redis)
	p50, p99 time.Duration
	max      time.Duration
}

// sampleLatency sends n requests to each row, round-robin, each with a new key.
func sampleLatency(rows []*latRow, n int, budget time.Duration) {
	ctx := context.Background()
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	end := time.Now().Add(budget)
	for k := 0; k < n && time.Now().Before(end); k++ {
		for _, r := range rows {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.url+"/", nil)
			req.Header.Set("X-Key", fmt.Sprintf("lat-%s-%d", tag, k))
			t0 := time.Now()
			resp, err := httpClient.Do(req)
			if err != nil {
				r.bad.add("transport error")
				continue
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			d := time.Since(t0)
			if resp.StatusCode != r.want {
				r.bad.add(strconv.Itoa(resp.StatusCode))
			} else if r.needHdr && resp.Header.Get("RateLimit") == "" {
				r.bad.add("no RateLimit field")
			}
			if d > 100*time.Millisecond {
				r.slow++
			}
			r.lat = append(r.lat, d)
		}
	}
	for _, r := range rows {
		r.p50, r.p99 = pct(r.lat, 0.5), pct(r.lat, 0.99)
		r.max = pct(r.lat, 1)
	}
}

func newLatRow(name string, port, want int, needHdr bool) *latRow {
	return &latRow{name: name, url: fmt.Sprintf("http://127.0.0.1:%d", port), want: want, needHdr: needHdr, bad: &errCount{}}
}

// ---- the run --------------------------------------------------------------------

type rlResult struct {
	err error

	tp        []*tpTarget // base first
	statsCmds int64       // EVALSHA+EVAL calls (commandstats) during the throughput run
	statsReqs int64       // rate-limited requests sent during it
	statsErr  error

	cmds []cmdRow

	peers []peerRow // the same decisions through redis_rate and an Envoy-style pipeline

	up      []*latRow // Redis up
	paused  []*latRow // Redis paused, breaker open
	opening []time.Duration
	openErr error
	recover time.Duration // SIGCONT → first decision by Redis again
	recErr  error
}

// oneReq sends one request with a key and returns status, RateLimit field, time.
func oneReq(url, key string) (int, string, time.Duration, error) {
	req, _ := http.NewRequest(http.MethodGet, url+"/", nil)
	req.Header.Set("X-Key", key)
	t0 := time.Now()
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, "", time.Since(t0), err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("RateLimit"), time.Since(t0), nil
}

func runRateLimit(step func(string, ...any)) *rlResult {
	res := &rlResult{}
	step("rate limit: starting redis-server ×2 and caddy (rate-limit sites)")
	rr, err := startRedis("redisRL")
	if err != nil {
		res.err = err
		return res
	}
	rp, err := startRedis("redisPause")
	if err != nil {
		res.err = err
		return res
	}
	var p rlPorts
	for _, q := range []*int{&p.base, &p.sw, &p.gcra, &p.denySW, &p.denyGCRA, &p.pOpen, &p.pClosed} {
		if *q, err = freePort(); err != nil {
			res.err = err
			return res
		}
	}
	cp, err := startCaddy("caddyRL", globalOpts("rl")+rlSites(p, rr.addr(), rp.addr()),
		p.base, p.sw, p.gcra, p.denySW, p.denyGCRA, p.pOpen, p.pClosed)
	if err != nil {
		res.err = err
		return res
	}
	rc := redis.NewClient(&redis.Options{Addr: rr.addr()})
	defer rc.Close()
	ctx := context.Background()

	// 1. Throughput, targets alternated and their order rotated per round.
	tps := []*tpTarget{
		{name: "Caddy, `respond` only (base)", url: fmt.Sprintf("http://127.0.0.1:%d", p.base)},
		{name: "`redis_ratelimit` sliding_window (`rate 100000 1s`) + `respond`", url: fmt.Sprintf("http://127.0.0.1:%d", p.sw), limited: true},
		{name: "`redis_ratelimit` gcra (`rate 1000000 1s`) + `respond`", url: fmt.Sprintf("http://127.0.0.1:%d", p.gcra), limited: true},
	}
	for _, t := range tps {
		t.errs = &errCount{}
		t.ratioTo = nil
	}
	res.tp = tps
	step("rate limit: throughput, %d clients, %d keys each, %d rounds × %d targets × (0.5 s warm-up + %s)",
		*rlClients, *rlKeys, *rlRounds, len(tps), *rlMeasure)
	for _, t := range tps { // scripts loaded, connections open
		closedLoop(t, *rlClients, 300*time.Millisecond, 0)
	}
	var limitedBefore int64
	for _, t := range tps[1:] {
		limitedBefore += t.sent.Load()
	}
	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		res.statsErr = err
	}
	for round := 0; round < *rlRounds; round++ {
		perRound := make([]float64, len(tps))
		for k := range tps {
			i := (k + round) % len(tps)
			t := tps[i]
			cpus := []func() float64{
				func() float64 { return cpuSeconds(cp.cmd.Process.Pid) },
				func() float64 { return redisCPU(rc) }, // INFO cpu delta, as the cost goal is defined
				func() float64 { return cpuSeconds(os.Getpid()) },
			}
			n, d, grew := closedLoop(t, *rlClients, 300*time.Millisecond, *rlMeasure, cpus...)
			for j := range cpus {
				t.cpu[j] += grew[j]
			}
			t.reqs += n
			t.dur += d
			perRound[i] = float64(n) / d.Seconds()
			t.rounds = append(t.rounds, perRound[i])
		}
		for i, t := range tps {
			if perRound[0] > 0 {
				t.ratioTo = append(t.ratioTo, perRound[i]/perRound[0])
			}
		}
	}
	if res.statsErr == nil {
		var limitedAfter int64
		for _, t := range tps[1:] {
			limitedAfter += t.sent.Load()
		}
		res.statsReqs = limitedAfter - limitedBefore
		res.statsCmds, res.statsErr = scriptCalls(rc)
	}

	// 2. Commands per request under MONITOR (top-level commands only).
	seqCmds := func(what, url string) cmdRow {
		step("rate limit: commands, %s, %d sequential requests on distinct keys under MONITOR", what, *seqN)
		row := cmdRow{what: what, unit: "request", goal: 1}
		tag := strconv.FormatInt(time.Now().UnixNano(), 36)
		for i := 0; i < 10; i++ {
			oneReq(url, fmt.Sprintf("cw-%s-%d", tag, i))
		}
		m, err := startMonitor(rr.addr())
		if err != nil {
			row.err = err
			return row
		}
		bad := &errCount{}
		for i := 0; i < *seqN; i++ {
			code, hdr, _, err := oneReq(url, fmt.Sprintf("c-%s-%d", tag, i))
			row.reqs++
			switch {
			case err != nil:
				bad.add("transport error")
			case code != 200:
				bad.add(strconv.Itoa(code))
			case hdr == "":
				bad.add("no RateLimit field")
			}
		}
		row.cmds, row.breakdown = m.stop()
		if s := bad.String(); s != "0" {
			row.breakdown += " · answers not 200 with RateLimit: " + s
		}
		return row
	}
	res.cmds = append(res.cmds, seqCmds("`redis_ratelimit` sliding_window, sequential", tps[1].url))
	res.cmds = append(res.cmds, seqCmds("`redis_ratelimit` gcra, sequential", tps[2].url))
	concCmds := func(what string, t *tpTarget) cmdRow {
		step("rate limit: commands, %s, %d clients for 1 s under MONITOR", what, *rlClients)
		row := cmdRow{what: what, unit: "request", goal: 1}
		m, err := startMonitor(rr.addr())
		if err != nil {
			row.err = err
			return row
		}
		before := t.sent.Load()
		closedLoop(t, *rlClients, 0, time.Second)
		row.reqs = int(t.sent.Load() - before)
		row.cmds, row.breakdown = m.stop()
		return row
	}
	res.cmds = append(res.cmds, concCmds(fmt.Sprintf("`redis_ratelimit` sliding_window, %d concurrent clients (pipelined)", *rlClients), tps[1]))
	denyCmds := func(what, url string) cmdRow {
		step("rate limit: deny cache, %s, %d requests on one key under MONITOR", what, *rlDenyN)
		row := cmdRow{what: what, unit: "request", goal: 0, zeroGoal: true}
		key := "deny-" + strconv.FormatInt(time.Now().UnixNano(), 36)
		m, err := startMonitor(rr.addr())
		if err != nil {
			row.err = err
			return row
		}
		c1, _, _, e1 := oneReq(url, key)
		c2, _, _, e2 := oneReq(url, key)
		time.Sleep(200 * time.Millisecond) // MONITOR lines of the first two arrive
		first, _ := m.snapshot()
		bad := &errCount{}
		for i := 2; i < *rlDenyN; i++ {
			code, _, _, err := oneReq(url, key)
			row.reqs++
			if err != nil {
				bad.add("transport error")
			} else if code != 429 {
				bad.add(strconv.Itoa(code))
			}
		}
		total, breakdown := m.stop()
		row.cmds = total - first
		row.breakdown = fmt.Sprintf("first two requests: %d, %d → %d commands (%s); later ones: %s", c1, c2, first, breakdown, breakdownOr(row.cmds))
		if e1 != nil || e2 != nil || c1 != 200 || c2 != 429 {
			row.breakdown += " ✘ expected 200 then 429"
		}
		if s := bad.String(); s != "0" {
			row.breakdown += " · later answers not 429: " + s
		}
		return row
	}
	res.cmds = append(res.cmds, denyCmds("client in the deny cache (`rate 1 1m`), sliding_window: requests 3…N", fmt.Sprintf("http://127.0.0.1:%d", p.denySW)))
	res.cmds = append(res.cmds, denyCmds("client in the deny cache (`rate 1 1m`), gcra: requests 3…N", fmt.Sprintf("http://127.0.0.1:%d", p.denyGCRA)))

	// 3. Decision latency: Redis up, then paused with the breaker open.
	step("rate limit: latency, %d sequential requests each, Redis up", *seqN)
	res.up = []*latRow{
		newLatRow("Caddy, `respond` only (base)", p.base, 200, false),
		newLatRow("sliding_window, Redis up", p.sw, 200, true),
		newLatRow("gcra, Redis up", p.gcra, 200, true),
		newLatRow("sliding_window, fail open, its own Redis (before the pause)", p.pOpen, 200, true),
	}
	sampleLatency(res.up, *seqN, 20*time.Second)

	step("rate limit: Redis paused (SIGSTOP), breaker opening, then %d requests each", *seqN)
	rp.cmd.Process.Signal(syscall.SIGSTOP)
	pausedAt := time.Now()
	// Open the breaker: requests that wait for the paused Redis (each at
	// most `timeout`, 500 ms by default), until one is answered at once.
	for i := 0; i < 10; i++ {
		_, _, d, err := oneReq(fmt.Sprintf("http://127.0.0.1:%d", p.pOpen), fmt.Sprintf("open-%d", i))
		if err != nil {
			res.openErr = err
			break
		}
		res.opening = append(res.opening, d)
		if d < 50*time.Millisecond && i >= 2 {
			break
		}
	}
	res.paused = []*latRow{
		newLatRow("Caddy, `respond` only (base, during the pause)", p.base, 200, false),
		newLatRow("Redis paused, breaker open, fail open (200)", p.pOpen, 200, false),
		newLatRow("Redis paused, breaker open, `fail_closed` (503)", p.pClosed, 503, false),
	}
	sampleLatency(res.paused, *seqN, 20*time.Second)
	pausedFor := time.Since(pausedAt)
	rp.cmd.Process.Signal(syscall.SIGCONT)
	resumed := time.Now()
	res.recErr = fmt.Errorf("no decision by Redis within 5 s of SIGCONT (paused %.1f s)", pausedFor.Seconds())
	for i := 0; time.Since(resumed) < 5*time.Second; i++ {
		_, hdr, _, err := oneReq(fmt.Sprintf("http://127.0.0.1:%d", p.pOpen), fmt.Sprintf("rec-%d", i))
		if err == nil && hdr != "" {
			res.recover, res.recErr = time.Since(resumed), nil
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	res.peers = runRateLimitPeers(step, *rlClients, 1000, 3*time.Second)
	return res
}

func breakdownOr(n int) string {
	if n == 0 {
		return "none"
	}
	return strconv.Itoa(n)
}

// scriptCalls is the number of top-level script calls Redis counted
// (commandstats counts EVALSHA/EVAL once per call; the commands inside a
// script are counted under their own names).
func scriptCalls(c *redis.Client) (int64, error) {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var n int64
	for _, l := range strings.Split(info, "\n") {
		l = strings.TrimSpace(l)
		for _, name := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			if rest, ok := strings.CutPrefix(l, name); ok {
				for _, f := range strings.Split(rest, ",") {
					if v, ok := strings.CutPrefix(f, "calls="); ok {
						x, _ := strconv.ParseInt(v, 10, 64)
						n += x
					}
				}
			}
		}
	}
	return n, nil
}

// perRequest is a target's CPU per request in µs (caddy, redis, bench):
// CPU time over the measured parts ÷ the answers completed in them.
func perRequest(t *tpTarget) (cpu [3]float64, ok bool) {
	if t.reqs <= 0 {
		return cpu, false
	}
	for i := range cpu {
		cpu[i] = t.cpu[i] / float64(t.reqs) * 1e6
	}
	return cpu, true
}

// printRateLimitCost prints the cost goals per decision from the throughput
// run: Redis CPU per decision, Caddy CPU added over `respond` alone, and the
// throughput ratio.
func printRateLimitCost(p func(string, ...any), r *rlResult) {
	if len(r.tp) < 3 {
		return
	}
	base, okBase := perRequest(r.tp[0])
	baseRate := float64(r.tp[0].reqs) / max(r.tp[0].dur.Seconds(), 1e-9)
	p("Cost per decision, from the throughput run above (%d clients):", *rlClients)
	p("")
	p("| figure | %s | %s | goal |", "sliding_window", "gcra")
	p("|---|---|---|---|")
	var redisRow, caddyRow, ratioRow []string
	okRedis, okCaddy, okRatio := true, true, true
	for _, t := range r.tp[1:3] {
		c, ok := perRequest(t)
		if !ok || !okBase || baseRate <= 0 {
			redisRow, caddyRow, ratioRow = append(redisRow, "—"), append(caddyRow, "—"), append(ratioRow, "—")
			okRedis, okCaddy, okRatio = false, false, false
			continue
		}
		ratio := float64(t.reqs) / max(t.dur.Seconds(), 1e-9) / baseRate
		redisRow = append(redisRow, fmt.Sprintf("%.1f µs", c[1]))
		caddyRow = append(caddyRow, fmt.Sprintf("%.1f µs", c[0]-base[0]))
		ratioRow = append(ratioRow, fmt.Sprintf("%.3f", ratio))
		okRedis, okCaddy, okRatio = okRedis && c[1] <= 4, okCaddy && c[0]-base[0] <= 8, okRatio && ratio >= 0.7
	}
	p("| Redis CPU per decision (`INFO cpu` delta ÷ requests) | %s | %s | ≤ 4 µs %s |", redisRow[0], redisRow[1], check(okRedis))
	p("| Caddy CPU added per request over `respond` alone | %s | %s | ≤ 8 µs %s |", caddyRow[0], caddyRow[1], check(okCaddy))
	p("| throughput ÷ `respond` only | %s | %s | ≥ 0.7 %s |", ratioRow[0], ratioRow[1], check(okRatio))
	p("")
	p("The µs thresholds of this table are for scale; the goals are same-run ratios (throughput ÷ plain, Redis CPU ÷ the exact floor, Caddy CPU added ÷ the `respond` request's, latency added ÷ one PING), measured over 1000 keys in the \"Cost goals (same-run ratios)\" table at the end.")
	p("")
}

// ---- report ---------------------------------------------------------------------

func printRateLimit(p func(string, ...any), r *rlResult) {
	p("### Rate limit (`redis_ratelimit`)")
	p("")
	if r == nil {
		return
	}
	if r.err != nil {
		p("error: %s", oneLine(r.err))
		p("")
		return
	}
	p("Throughput: %d closed-loop keep-alive clients (each cycling through %d keys), %d rounds of %s per target after 0.3 s warm-up, targets alternated and their order rotated each round; one Caddy process, one redis-server.", *rlClients, *rlKeys, *rlRounds, *rlMeasure)
	p("")
	p("| target | req/s | ÷ `respond` only | median of per-round ratios (all rounds) | goal | CPU µs per request: Caddy · Redis · load generator | errors · not decided by Redis |")
	p("|---|---|---|---|---|---|---|")
	base := r.tp[0]
	baseRate := float64(base.reqs) / max(base.dur.Seconds(), 1e-9)
	for i, t := range r.tp {
		rate := float64(t.reqs) / max(t.dur.Seconds(), 1e-9)
		ratio, goal, rounds := "1.00", "—", "—"
		if i > 0 && baseRate > 0 {
			ratio = fmt.Sprintf("**%.3f**", rate/baseRate)
			goal = fmt.Sprintf("≥ 0.6 %s", check(rate/baseRate >= 0.6))
			var parts []string
			for _, x := range t.ratioTo {
				parts = append(parts, fmt.Sprintf("%.2f", x))
			}
			sorted := append([]float64(nil), t.ratioTo...)
			sort.Float64s(sorted)
			med := 0.0
			if len(sorted) > 0 {
				med = sorted[len(sorted)/2]
			}
			rounds = fmt.Sprintf("%.2f (%s)", med, strings.Join(parts, ", "))
		} else {
			var parts []string
			for _, x := range t.rounds {
				parts = append(parts, fmt.Sprintf("%.0f", x))
			}
			rounds = "req/s " + strings.Join(parts, ", ")
		}
		integrity := ""
		if t.limited {
			integrity = fmt.Sprintf(" · %d", t.noHdr.Load())
		}
		cpu := "—"
		if c, ok := perRequest(t); ok {
			cpu = fmt.Sprintf("%.0f · %.0f · %.0f", c[0], c[1], c[2])
		}
		p("| %s | %.0f | %s | %s | %s | %s | %s%s |", t.name, rate, ratio, rounds, goal, cpu, t.errs.String(), integrity)
	}
	p("")
	printRateLimitCost(p, r)
	p("Redis commands per rate-limited request (MONITOR, top-level commands only; a script call is one):")
	p("")
	p("| run | requests | commands | per request | goal | by command |")
	p("|---|---|---|---|---|---|")
	for _, c := range r.cmds {
		if c.err != nil && c.reqs == 0 {
			p("| %s | — | — | — | — | error: %s |", c.what, oneLine(c.err))
			continue
		}
		per := float64(c.cmds) / float64(max(1, c.reqs))
		goal := fmt.Sprintf("= %.0f %s", c.goal, check(per > c.goal-1e-9 && per < c.goal+1e-9))
		if c.zeroGoal {
			goal = fmt.Sprintf("= 0 %s", check(c.cmds == 0))
		} else if strings.HasSuffix(c.what, "(pipelined)") {
			// The decisions that meet in one pipeline share one script
			// call (a batch), so concurrent requests cost less.
			goal = fmt.Sprintf("≤ 1 %s", check(per < 1.005 && c.cmds > 0))
		} else if c.goal > 0 {
			// = 1 sequentially (every request is a call); a few extra
			// connection-setup commands may show up.
			goal = fmt.Sprintf("= 1 %s", check(per < 1.005 && per > 0.995))
		}
		p("| %s | %d | %d | **%.3f** per %s | %s | %s |", c.what, c.reqs, c.cmds, per, c.unit, goal, c.breakdown)
	}
	if r.statsErr != nil {
		p("| throughput run (commandstats) | — | — | — | — | error: %s |", oneLine(r.statsErr))
	} else {
		per := float64(r.statsCmds) / float64(max(1, r.statsReqs))
		p("| throughput run above, all rate-limited requests (Redis `commandstats`: EVALSHA + EVAL calls) | %d | %d | **%.3f** per request | ≤ 1 %s | no MONITOR: full speed, pipelined (decisions of one pipeline share a script call) |",
			r.statsReqs, r.statsCmds, per, check(per < 1.005 && r.statsCmds > 0))
	}
	p("")
	p("Decision latency, sequential requests on new keys, sampled round-robin (HTTP round trip client → Caddy → `respond`):")
	p("")
	p("| run | p50 | p99 | max | n | over 100 ms | goal | wrong answers |")
	p("|---|---|---|---|---|---|---|---|")
	row := func(l *latRow, goal string) {
		p("| %s | %s | **%s** | %s | %d | %d | %s | %s |", l.name, ms(l.p50), ms(l.p99), ms(l.max), len(l.lat), l.slow, goal, l.bad.String())
	}
	for _, l := range r.up {
		row(l, "—")
	}
	var opening []string
	for _, d := range r.opening {
		opening = append(opening, fmt.Sprintf("%.0f", float64(d)/1e6))
	}
	for _, l := range r.paused {
		goal := "—"
		if l.want != 0 && strings.Contains(l.name, "paused") {
			// Our criterion: answered without waiting for Redis, i.e. p99
			// far below `timeout` (500 ms).
			goal = fmt.Sprintf("p99 < 50 ms (≪ timeout 500 ms) %s", check(len(l.lat) > 0 && l.p99 < 50*time.Millisecond && l.bad.String() == "0"))
		}
		row(l, goal)
	}
	p("")
	openNote := "Opening the breaker (SIGSTOP, then sequential requests until one is answered at once): " + strings.Join(opening, ", ") + " ms"
	if r.openErr != nil {
		openNote += "; error: " + oneLine(r.openErr)
	}
	p("%s. After SIGCONT, first decision by Redis again after %s.", openNote, recoverText(r))
	p("")
	p("Rate-limit notes:")
	p("- Throughput: every site is `redis_ratelimit { key {http.request.header.X-Key} … }` + `respond \"ok\"` in one Caddy process (the base site is the same process with `respond` only); the limits are the largest each algorithm accepts per second (sliding_window n ≤ 100000, gcra ≥ 1 µs per request), so nothing is rejected. The load generator runs in the bench process on the same 2 cores: it takes CPU from Caddy and Redis alike, which narrows the gap (a faster client would show a lower ratio). CPU: Redis from its `INFO cpu` delta (used_cpu_user + used_cpu_sys), Caddy and the load generator from /proc (10 ms ticks); each read at the start and the end of every measured part, ÷ the answers completed inside those parts (warm-ups excluded). \"Not decided by Redis\" counts 200s without a `RateLimit` field (a silent fail-open would show there).")
	p("- Commands: a pipeline's decisions go as one call of the decision script, which takes a batch: concurrent rows are below 1 command per request, sequential rows exactly 1. Sequential rows count every request sent while MONITOR ran; the concurrent row divides by the requests sent in that second. Deny-cache rows: request 1 is admitted, request 2 rejected by Redis (a script call each), requests 3…N must be answered from memory (0 commands) with 429.")
	p("- Paused: a dedicated redis-server is SIGSTOPped after traffic opened connections; requests wait for it (each at most `timeout`, default 500 ms) until 3 consecutive failures open the breaker; then the rows are sampled. The breaker lets one request through to probe Redis about once a second; that request waits the full timeout (counted in \"over 100 ms\"). The goal column is this bench's own criterion (no number is set for it): p99 far below the timeout, i.e. no waiting for Redis.")
	p("")
	printRateLimitPeers(p, r.peers, *rlClients, 1000)
}

func recoverText(r *rlResult) string {
	if r.recErr != nil {
		return "— (" + oneLine(r.recErr) + ")"
	}
	return fmt.Sprintf("%.2f s (breaker probes about once a second)", r.recover.Seconds())
}

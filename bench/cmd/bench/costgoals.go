package main

// The cost goals of docs/benchmarks.md ("Cost per rate-limit decision", "Cost per
// uncontended locked request", the uncontended latency goal), every figure
// a ratio to a reference measured in the same run, on the same Redis: the
// absolute µs on this shared 2-core machine move 3× between days, a ratio
// of two loads measured one right after the other does not.
//
// The part starts its own processes: one Caddy (a `respond` site, a
// `redis_lock` + `respond` site, two `redis_ratelimit` + `respond` sites),
// one redis-server for the lock and one for the rate limiter, and a second
// Caddy with the floor handlers, for scale (floorhandler.go). Each round
// runs every load once, the order rotated from round to round; a ratio is
// taken within a round and the figure is the median of the rounds' ratios.

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	onlyCost        = flag.Bool("only-cost", false, "run the cost-goal parts only (lock cost, rate-limit cost) and print the \"Cost goals (same-run ratios)\" table")
	costClients     = flag.Int("cost-clients", 64, "cost goals: concurrent keep-alive clients (and go-redis callers of the references)")
	costKeys        = flag.Int("cost-keys", 1000, "cost goals: keys the clients spread over")
	costRounds      = flag.Int("cost-rounds", 4, "cost goals, lock part: rounds (each runs every load once, order rotated)")
	costRLRounds    = flag.Int("cost-rl-rounds", 6, "cost goals, rate-limit part: rounds (each runs every load once, order rotated)")
	costLockMeasure = flag.Duration("cost-lock-measure", 3*time.Second, "cost goals: measured time per load and round, lock part")
	costRLMeasure   = flag.Duration("cost-rl-measure", 1500*time.Millisecond, "cost goals: measured time per load and round, rate-limit part")
	costWarm        = flag.Duration("cost-warm", 300*time.Millisecond, "cost goals: unmeasured warm-up before each measured load")
)

// ---- one measured load ------------------------------------------------------------

// costSample is one load measured once: what was done, over which time,
// and the CPU and connection counters' growth over exactly that time.
type costSample struct {
	ops      int64         // requests (or reference operations) that succeeded
	dur      time.Duration // measured time
	caddyCPU float64       // seconds
	selfCPU  float64       // seconds: this process's (the load generator, or a reference's go-redis client)
	redisCPU float64       // seconds
	conns    int64         // total_connections_received growth
	errs     int64
	machine  machineTicks // the whole machine's CPU time over the measured time (/proc/stat)
}

// machineTicks is the machine's CPU time (/proc/stat's first line, all
// cores, USER_HZ ticks): how much of it the hypervisor took (steal) and how
// much nobody used (idle), out of all of it.
type machineTicks struct{ steal, idle, total int64 }

// parseProcStat reads the "cpu" line of /proc/stat: user nice system idle
// iowait irq softirq steal (guest time is counted in user already).
func parseProcStat(b []byte) machineTicks {
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return machineTicks{}
	}
	var t machineTicks
	for i, v := range f[1:9] {
		n, _ := strconv.ParseInt(v, 10, 64)
		t.total += n
		switch i {
		case 3, 4: // idle, iowait
			t.idle += n
		case 7:
			t.steal = n
		}
	}
	return t
}

func readMachineTicks() machineTicks {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return machineTicks{}
	}
	return parseProcStat(b)
}

func (t machineTicks) minus(o machineTicks) machineTicks {
	return machineTicks{t.steal - o.steal, t.idle - o.idle, t.total - o.total}
}

// share of the machine's CPU time (0 when unknown).
func (t machineTicks) share(x int64) float64 {
	if t.total <= 0 {
		return 0
	}
	return float64(x) / float64(t.total)
}

func (s costSample) rate() float64 { return float64(s.ops) / max(s.dur.Seconds(), 1e-9) }

// per is x (seconds) per operation, in µs.
func (s costSample) per(x float64) float64 {
	if s.ops <= 0 {
		return 0
	}
	return x / float64(s.ops) * 1e6
}

// costLoad is one load of a cost round.
type costLoad struct {
	name    string
	perCall int64 // operations per successful call of do (default 1)
	do      func(ctx context.Context, c, i int) error
	samples []costSample // one per round
	lastErr atomic.Pointer[string]
	pid     int // the Caddy whose CPU it costs, when not the part's own (the floor handlers')
}

// redisInfoInt is one integer field of an INFO section.
func redisInfoInt(c *redis.Client, section, field string) int64 {
	info, err := c.Info(context.Background(), section).Result()
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return -1
}

// measureLoad runs clients goroutines closed-loop over l.do for warm (not
// measured), then for measure, and reads the counters right before and
// right after the measured part (after every call in it has returned). A
// call that fails is counted and the goroutine goes on after 10 ms.
func measureLoad(l *costLoad, clients int, warm, measure time.Duration, caddyPid int, info *redis.Client) costSample {
	loop := func(d time.Duration) (ok, bad int64) {
		stop := time.Now().Add(d)
		var okN, badN atomic.Int64
		var wg sync.WaitGroup
		ctx, cancel := context.WithDeadline(context.Background(), stop.Add(5*time.Second))
		defer cancel()
		for c := 0; c < clients; c++ {
			wg.Add(1)
			go func(c int) {
				defer wg.Done()
				for i := 0; time.Now().Before(stop); i++ {
					if err := l.do(ctx, c, i); err != nil {
						badN.Add(1)
						s := oneLine(err)
						l.lastErr.Store(&s)
						time.Sleep(10 * time.Millisecond)
						continue
					}
					okN.Add(1)
				}
			}(c)
		}
		wg.Wait()
		return okN.Load(), badN.Load()
	}
	if warm > 0 {
		loop(warm)
	}
	var s costSample
	if l.pid > 0 {
		caddyPid = l.pid
	}
	caddy := func() float64 {
		if caddyPid <= 0 {
			return 0
		}
		return cpuSeconds(caddyPid)
	}
	self := os.Getpid()
	c0, r0, m0, n0, t0 := caddy(), redisCPU(info), cpuSeconds(self), redisInfoInt(info, "stats", "total_connections_received"), time.Now()
	k0 := readMachineTicks()
	ok, bad := loop(measure)
	s.machine = readMachineTicks().minus(k0)
	s.dur = time.Since(t0)
	s.caddyCPU, s.redisCPU, s.selfCPU = caddy()-c0, redisCPU(info)-r0, cpuSeconds(self)-m0
	s.conns = redisInfoInt(info, "stats", "total_connections_received") - n0
	s.ops, s.errs = ok*max(l.perCall, 1), bad
	return s
}

// runCostRounds runs rounds rounds of every load, the order rotated per round.
func runCostRounds(step func(string, ...any), what string, loads []*costLoad, rounds, clients int, measure time.Duration, caddyPid int, info *redis.Client) {
	for _, l := range loads { // scripts loaded, pools and keep-alive connections open
		measureLoad(l, clients, *costWarm, 0, caddyPid, info)
	}
	for r := 0; r < rounds; r++ {
		step("cost goals, %s: round %d of %d (%d loads × (%s warm-up + %s))", what, r+1, rounds, len(loads), *costWarm, measure)
		got := make([]costSample, len(loads))
		for k := range loads {
			i := (k + r) % len(loads)
			got[i] = measureLoad(loads[i], clients, *costWarm, measure, caddyPid, info)
		}
		for i, l := range loads {
			l.samples = append(l.samples, got[i])
		}
	}
}

// median of per-round values (the mean of the middle two for an even count).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// perRound applies f to the samples of two loads round by round.
func perRound(a, b *costLoad, f func(a, b costSample) float64) []float64 {
	var out []float64
	for r := 0; r < len(a.samples) && r < len(b.samples); r++ {
		out = append(out, f(a.samples[r], b.samples[r]))
	}
	return out
}

// perLoad applies f to each round's sample of one load.
func perLoad(a *costLoad, f func(costSample) float64) []float64 {
	var out []float64
	for _, s := range a.samples {
		out = append(out, f(s))
	}
	return out
}

func roundsText(xs []float64, format string) string {
	var parts []string
	for _, x := range xs {
		parts = append(parts, fmt.Sprintf(format, x))
	}
	return strings.Join(parts, ", ")
}

// ---- the summary rows -------------------------------------------------------------

// costGoal is one row of the summary table.
type costGoal struct {
	figure    string
	measured  string // the ratio (and what it divides)
	reference string // what it was divided by, with its own value
	goal      string
	met       bool
	noGoal    bool // a figure printed for scale: no verdict
	err       error
}

// ratioGoal builds a row whose figure is the median of per-round ratios.
func ratioGoal(figure string, rounds []float64, measuredAbs, reference string, atMost bool, limit float64) costGoal {
	g := costGoal{figure: figure, reference: reference}
	if len(rounds) == 0 {
		g.err = fmt.Errorf("no round measured")
		return g
	}
	m := median(rounds)
	meets := func(x float64) bool { return (atMost && x <= limit) || (!atMost && x >= limit) }
	g.met = meets(m)
	// Two decimals, or three where two would read as the other verdict
	// (a median of 0.695 against ≥ 0.7 is not "0.70, no").
	shown := fmt.Sprintf("%.2f", m)
	if x, _ := strconv.ParseFloat(shown, 64); meets(x) != g.met {
		shown = fmt.Sprintf("%.3f", m)
	}
	g.measured = fmt.Sprintf("**%s** (%s; rounds %s)", shown, measuredAbs, roundsText(rounds, "%.2f"))
	if len(rounds) == 1 {
		g.measured = fmt.Sprintf("**%s** (%s)", shown, measuredAbs)
	}
	bound := strconv.FormatFloat(limit, 'f', -1, 64)
	if atMost {
		g.goal = "≤ " + bound
	} else {
		g.goal = "≥ " + bound
	}
	return g
}

func printCostGoals(p func(string, ...any), res *costResult) {
	p("### Cost goals (same-run ratios)")
	p("")
	if res == nil {
		return
	}
	la := strings.Fields(string(res.loadAvg))
	if len(la) > 3 {
		la = la[:3]
	}
	p("%s · nproc %d · load average before the part %s · %s · %d clients over %d keys · loads alternated, their order rotated per round: lock %d rounds of %s per load, rate limit %d rounds of %s per load, each after %s warm-up; each figure is the median of its per-round ratios, but for the lock's Caddy CPU row (the ratio of the medians), the latency rows (ratios of sequential p50s), the Redlock and hot-key rows (one load of each, from the parts above) and the connections (a count).",
		res.at.UTC().Format("2006-01-02 15:04 MST"), res.nproc, strings.Join(la, " "), orDash(res.machine), *costClients, *costKeys, *costRounds, *costLockMeasure, *costRLRounds, *costRLMeasure, *costWarm)
	p("")
	p("| figure | measured | reference (divided by) | goal | met? |")
	p("|---|---|---|---|---|")
	for _, g := range res.goals {
		if g.err != nil {
			met := "no"
			if g.noGoal {
				met = "—"
			}
			p("| %s | — (%s) | %s | %s | %s |", g.figure, oneLine(g.err), orDash(g.reference), orDash(g.goal), met)
			continue
		}
		met := "no"
		switch {
		case g.noGoal:
			met = "—"
		case g.met:
			met = "yes"
		}
		p("| %s | %s | %s | %s | %s |", g.figure, g.measured, g.reference, g.goal, met)
	}
	p("")
	for _, n := range res.notes {
		p("- %s", n)
	}
	if len(res.notes) > 0 {
		p("")
	}
}

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

// ---- the run ----------------------------------------------------------------------

type costResult struct {
	at      time.Time
	nproc   int
	loadAvg []byte
	goals   []costGoal
	notes   []string
	machine string // the machine's CPU steal and idle over the measured loads
}

// machineNote sums up the whole machine's CPU over every measured load: the
// share the hypervisor took from this VM (steal) and the share left idle.
// Steal above a few % is not a quiet machine: its rounds spread and the
// ratios move with it.
func machineNote(loads []*costLoad) string {
	var steal, idle []float64
	for _, l := range loads {
		for _, s := range l.samples {
			if s.machine.total > 0 {
				steal = append(steal, s.machine.share(s.machine.steal))
				idle = append(idle, s.machine.share(s.machine.idle))
			}
		}
	}
	if len(steal) == 0 {
		return "machine CPU unknown (no /proc/stat)"
	}
	return fmt.Sprintf("CPU steal over the measured loads (the hypervisor's share of this machine's CPU time) median %.0f %%, max %.0f %%; idle median %.0f %%",
		100*median(steal), 100*slices.Max(steal), 100*median(idle))
}

// costSites: `respond` only, `redis_lock` (key = the path) + `respond`, and
// `redis_ratelimit` (key = the X-Key header, limits that never reject)
// sliding_window and gcra + `respond`.
func costSites(plain, lock, sw, gcra int, lockAddr, rlAddr string) string {
	rl := func(port int, opts string) string {
		return fmt.Sprintf("\nhttp://127.0.0.1:%d {\n\tredis_ratelimit {\n\t\tkey {http.request.header.X-Key}\n%s\t\tredis %s\n\t}\n\trespond \"ok\" 200\n}\n", port, opts, rlAddr)
	}
	return respondSite(plain) + lockRespondSite(lock, lockAddr) +
		rl(sw, "\t\trate 100000 1s\n") + rl(gcra, "\t\trate 1000000 1s\n\t\talgorithm gcra\n")
}

// lockKey gives client c its own keys out of n (c, c+clients, c+2·clients,
// … below n), so that no two clients ever ask for the same key: the lock is
// uncontended, as the goal is stated.
func lockKey(c, i, clients, n int) int {
	per := (n - c + clients - 1) / clients // how many of the n keys are c's
	if per <= 0 {
		return c
	}
	return c + clients*(i%per)
}

// delIfOwner is the owner-checked release of the lock floor.
var delIfOwner = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
	return redis.call('DEL', KEYS[1])
end
return 0
`)

// httpLoad is one HTTP request of a cost load on base: a lock request's
// path is its key, client c cycling through its own keys (lockKey); a
// rate-limit request (limited) spreads the clients over the same keys,
// shared, in its X-Key field. field: the answer must carry a RateLimit
// field (decided by redis_ratelimit, not let through unasked).
func httpLoad(base, tag string, limited, field bool, clients, keys int) func(ctx context.Context, c, i int) error {
	return func(ctx context.Context, c, i int) error {
		var req *http.Request
		if limited {
			req, _ = http.NewRequestWithContext(ctx, http.MethodGet, base+"/", nil)
			req.Header.Set("X-Key", fmt.Sprintf("rl-%s-%d", tag, (c*7919+i)%keys))
		} else {
			req, _ = http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("%s/lk-%s-%d", base, tag, lockKey(c, i, clients, keys)), nil)
		}
		resp, err := httpClient.Do(req)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		if field && resp.Header.Get("RateLimit") == "" {
			return fmt.Errorf("200 without a RateLimit field: not decided by Redis")
		}
		return nil
	}
}

func runCostGoals(step func(string, ...any), lockCost []lockCostRow, hot []hotResult) *costResult {
	res := &costResult{at: time.Now(), nproc: runtime.NumCPU()}
	res.loadAvg, _ = os.ReadFile("/proc/loadavg")
	fail := func(err error) *costResult {
		for _, f := range costFigures {
			res.goals = append(res.goals, costGoal{figure: f, err: err})
		}
		return res
	}
	step("cost goals: starting redis-server ×2 and caddy (respond, redis_lock, redis_ratelimit ×2)")
	rLock, err := startRedis("redisCostLock")
	if err != nil {
		return fail(err)
	}
	rRL, err := startRedis("redisCostRL")
	if err != nil {
		return fail(err)
	}
	var plainP, lockP, swP, gcraP int
	for _, q := range []*int{&plainP, &lockP, &swP, &gcraP} {
		if *q, err = freePort(); err != nil {
			return fail(err)
		}
	}
	cp, err := startCaddy("caddyCost", globalOpts("cost")+costSites(plainP, lockP, swP, gcraP, rLock.addr(), rRL.addr()), plainP, lockP, swP, gcraP)
	if err != nil {
		return fail(err)
	}
	pid := cp.cmd.Process.Pid
	clients, keys := *costClients, *costKeys
	url := func(port int) string { return fmt.Sprintf("http://127.0.0.1:%d", port) }
	tag := strconv.FormatInt(time.Now().UnixNano()%1e6, 36)
	step("cost goals: starting the floor handlers' caddy (bin/caddy-ceiling: respond, bench_floor_lock, bench_floor_ratelimit, each also batched)")
	floor := startFloorHandlers(rLock.addr(), rRL.addr(), tag, clients, keys)

	// HTTP loads. A lock request's path is its key: client c cycles
	// through its own keys. A rate-limit request's X-Key spreads the
	// clients over the same keys, shared (nothing is ever rejected).
	httpDo := func(base string, limited bool) func(ctx context.Context, c, i int) error {
		return httpLoad(base, tag, limited, limited, clients, keys)
	}

	// ---- lock ----
	lockInfo := redis.NewClient(&redis.Options{Addr: rLock.addr(), PoolSize: 1})
	defer lockInfo.Close()
	lockRC := redis.NewClient(&redis.Options{Addr: rLock.addr(), PoolSize: clients, MinIdleConns: clients})
	defer lockRC.Close()
	plainL := &costLoad{name: "plain (lock rounds)", do: httpDo(url(plainP), false)}
	lockedL := &costLoad{name: "locked", do: httpDo(url(lockP), false)}
	floorL := &costLoad{name: "lock floor", do: func(ctx context.Context, c, i int) error {
		key := fmt.Sprintf("floor-%s-%d", tag, lockKey(c, i, clients, keys))
		token := fmt.Sprintf("%d-%d", c, i)
		ok, err := lockRC.Do(ctx, "SET", key, token, "NX", "PX", 8000).Result()
		if err != nil {
			return err
		}
		if ok != "OK" {
			return fmt.Errorf("floor: SET NX refused (%v)", ok)
		}
		return delIfOwner.Run(ctx, lockRC, []string{key}, token).Err()
	}}
	lockLoads := append([]*costLoad{plainL, lockedL, floorL}, floor.lockLoads()...)
	runCostRounds(step, fmt.Sprintf("lock (plain, locked, SET NX PX + DEL script floor, the floor handlers' plain, bench_floor_lock and bench_floor_lock batched; %d clients)", clients), lockLoads, *costRounds, clients, *costLockMeasure, pid, lockInfo)

	// Sequential latency, sampled round-robin: plain, one PING, locked,
	// and the row's floors (SET NX PX, the acquire script alone; see
	// latfloor.go), each after a spacer (see spaced).
	step("cost goals, lock: sequential latency, %d requests each, interleaved: respond, one PING, redis_lock, SET NX PX, the acquire script, redis_ratelimit sliding_window and gcra, the floor handlers' plain and bench_floor_lock", *seqN)
	pinger := redis.NewClient(&redis.Options{Addr: rLock.addr(), PoolSize: 1})
	defer pinger.Close()
	acquire, err := acquireFloor(pinger, tag)
	if err != nil {
		return fail(err)
	}
	seq := interleaved(spaced(url(plainP), append([]latTarget{
		{name: "plain", base: url(plainP)},
		{name: "ping", do: func(ctx context.Context) error { return pinger.Ping(ctx).Err() }},
		{name: "locked", base: url(lockP)},
		{name: "set nx", do: setNXFloor(pinger, tag)},
		{name: "acquire script", do: acquire},
		{name: "sliding_window", base: url(swP)},
		{name: "gcra", base: url(gcraP)},
	}, floor.latTargets()...)...), *seqN, 30*time.Second)

	// ---- rate limit ----
	rlInfo := redis.NewClient(&redis.Options{Addr: rRL.addr(), PoolSize: 1})
	defer rlInfo.Close()
	rlRC := redis.NewClient(&redis.Options{Addr: rRL.addr(), PoolSize: clients, MinIdleConns: clients})
	defer rlRC.Close()
	plainR := &costLoad{name: "plain (rate-limit rounds)", do: httpDo(url(plainP), false)} // `respond` only: no RateLimit field to expect
	swL := &costLoad{name: "sliding_window", do: httpDo(url(swP), true)}
	gcraL := &costLoad{name: "gcra", do: httpDo(url(gcraP), true)}
	const floorBatch = 25
	exactL := &costLoad{name: "exact floor", perCall: floorBatch, do: func(ctx context.Context, c, i int) error {
		ks := make([]string, floorBatch)
		for j := range ks {
			ks[j] = fmt.Sprintf("exact-%s-%d", tag, (c*7919+i*floorBatch+j)%keys)
		}
		return floorScript.Run(ctx, rlRC, ks).Err()
	}}
	rlLoads := append([]*costLoad{plainR, swL, gcraL, exactL}, floor.rlLoads()...)
	runCostRounds(step, fmt.Sprintf("rate limit (plain, sliding_window, gcra, exact floor, the floor handlers' plain, bench_floor_ratelimit and bench_floor_ratelimit batched; %d clients)", clients), rlLoads, *costRLRounds, clients, *costRLMeasure, pid, rlInfo)

	// The exact floor again, paced to each algorithm's own decision rate
	// (Redis idles between calls, as under the limited loads): a reference
	// printed beside the table, not one of its rows.
	const pacedRounds = 3
	paced := make([]*costLoad, 2)
	for k, l := range []*costLoad{swL, gcraL} {
		rate := median(perLoad(l, func(s costSample) float64 { return s.rate() }))
		paced[k] = pacedFloorLoad(fmt.Sprintf("exact floor paced to %s", l.name), rate, floorBatch, func(j int) []string {
			ks := make([]string, floorBatch)
			for x := range ks {
				ks[x] = fmt.Sprintf("paced-%s-%d", tag, (j*floorBatch+x)%keys)
			}
			return ks
		}, rlRC)
		step("cost goals, rate limit: the exact floor paced to the %s load's %.0f decisions/s, %d rounds", l.name, rate, pacedRounds)
		for r := 0; r < pacedRounds; r++ {
			paced[k].samples = append(paced[k].samples, measureLoad(paced[k], 1, *costWarm, *costRLMeasure, pid, rlInfo))
		}
	}

	res.goals = costGoalsFrom(costInputs{plainL: plainL, lockedL: lockedL, floorL: floorL, floor: floor, seq: seq,
		plainR: plainR, swL: swL, gcraL: gcraL, exactL: exactL, lockCost: lockCost, hot: hot})
	res.machine = machineNote(append(lockLoads, rlLoads...))
	res.notes = append(res.notes, clientFloorNote(plainL, lockedL, floorL), acquireFloorNote(seq), pacedFloorNote(swL, gcraL, exactL, paced),
		floor.note(plainL, lockedL, floorL, seq, plainR, swL, gcraL, exactL))
	for _, l := range append(lockLoads, rlLoads...) {
		var errs int64
		for _, s := range l.samples {
			errs += s.errs
		}
		if errs > 0 {
			last := ""
			if e := l.lastErr.Load(); e != nil {
				last = " (last: " + *e + ")"
			}
			res.notes = append(res.notes, fmt.Sprintf("✘ %s: %d failed calls in the measured rounds%s", l.name, errs, last))
		}
	}
	res.notes = append(res.notes,
		"CPU: Caddy's from /proc (user + system, 10 ms ticks), Redis's from its `INFO cpu` delta (used_cpu_user + used_cpu_sys, its network system calls included), each read right before and right after every measured load (after its last call returned) ÷ the calls that succeeded in it. Caddy CPU added = (per request of the load − per `respond` request of the same round) ÷ per `respond` request.",
		fmt.Sprintf("Lock: `redis_lock { key {http.request.uri.path} redis … }` + `respond`, defaults otherwise; each client cycles through its own of the %d keys (no two clients share a key: uncontended). Lock floor: the same clients' keys, `SET key token NX PX 8000` then an `EVALSHA` of `if GET == token then DEL`, go-redis, %d callers, on the lock's redis-server. New connections: `total_connections_received` of the lock's redis-server over every measured load of the lock rounds (plain, locked and floor; all pools opened in the warm-up before).", keys, clients),
		fmt.Sprintf("Rate limit: `redis_ratelimit { key {http.request.header.X-Key} rate … }` + `respond`, limits that never reject (sliding_window `rate 100000 1s`, gcra `rate 1000000 1s`), the %d clients over %d keys; exact floor: one `EVALSHA` per %d decisions doing only `GET` + `SET … PX 1000` on each of its %d keys, %d callers, on the rate limiter's redis-server. Sequential latency rows: requests without a key field (keyed by the client address), each decision one round trip.", clients, keys, floorBatch, floorBatch, clients),
		"Load generator, Caddy and both redis-servers share the machine's cores: a ratio compares two loads under the same conditions; the absolute values beside it are for orientation only.")
	return res
}

// clientFloorNote compares what the lock adds to Caddy's CPU with the
// client side of the lock floor: this process's CPU per SET NX PX + DEL
// script pair while it ran the floor load (go-redis, one round trip per
// command, the same callers), in the same rounds.
func clientFloorNote(plainL, lockedL, floorL *costLoad) string {
	var floorX, addedX []float64
	for r := 0; r < len(plainL.samples) && r < len(lockedL.samples) && r < len(floorL.samples); r++ {
		p, l, f := plainL.samples[r], lockedL.samples[r], floorL.samples[r]
		base, client := p.per(p.caddyCPU), f.per(f.selfCPU)
		floorX = append(floorX, client/max(base, 1e-9))
		addedX = append(addedX, (l.per(l.caddyCPU)-base)/max(client, 1e-9))
	}
	return fmt.Sprintf("The lock floor's client side, for scale: the bench process's own CPU per SET NX PX + DEL script pair while it ran the floor load (go-redis, %d callers, two round trips) is **%.2f ×** the `respond` request's Caddy CPU (rounds %s); what `redis_lock` adds to Caddy's CPU per request (handler, pipe and both calls) is %.2f × that client cost (rounds %s).",
		*costClients, median(floorX), roundsText(floorX, "%.2f"), median(addedX), roundsText(addedX, "%.2f"))
}

// pacedFloorLoad is the exact floor sent by one caller at rate decisions/s:
// one script of batch decisions every batch ÷ rate seconds, on the keys
// keysFor gives the j-th call (a call that falls behind is sent at once).
func pacedFloorLoad(name string, rate float64, batch int, keysFor func(j int) []string, rc *redis.Client) *costLoad {
	every := time.Duration(float64(batch) / max(rate, 1) * float64(time.Second))
	var next time.Time
	return &costLoad{name: name, perCall: int64(batch), do: func(ctx context.Context, _, i int) error {
		if now := time.Now(); next.Before(now) {
			next = now
		}
		time.Sleep(time.Until(next))
		next = next.Add(every)
		return floorScript.Run(ctx, rc, keysFor(i)).Err()
	}}
}

// pacedFloorNote compares each algorithm's Redis CPU per decision with the
// exact floor paced to that algorithm's decision rate.
func pacedFloorNote(swL, gcraL, exactL *costLoad, paced []*costLoad) string {
	redisUs := func(s costSample) float64 { return s.per(s.redisCPU) }
	rate := func(s costSample) float64 { return s.rate() }
	var parts []string
	for k, l := range []*costLoad{swL, gcraL} {
		p := paced[k]
		at, per := median(perLoad(p, rate)), median(perLoad(p, redisUs))
		parts = append(parts, fmt.Sprintf("%s: the floor at %.0f decisions/s costs Redis %.1f µs per decision (rounds %s), and the limited load's %.1f µs is **%.2f ×** that",
			l.name, at, per, roundsText(perLoad(p, redisUs), "%.1f"), median(perLoad(l, redisUs)), median(perLoad(l, redisUs))/max(per, 1e-9)))
	}
	return fmt.Sprintf("The exact floor at the limited loads' own rate, for scale (not a row of the table): one caller sends the floor's script of 25 decisions every 25 ÷ rate seconds, so Redis idles between calls as it does under the limited loads (one pipeline in flight per Caddy), where the table's floor keeps it busy with %d callers (%.0f decisions/s, %.1f µs per decision). %s.",
		*costClients, median(perLoad(exactL, rate)), median(perLoad(exactL, redisUs)), strings.Join(parts, "; "))
}

// costFigures names the rows, in order (also for a part that failed).
var costFigures = []string{
	"Lock: throughput ÷ `bench_floor_lock batched`'s (each ÷ its own Caddy's `respond`)",
	"Lock: Caddy CPU added ÷ `bench_floor_lock batched`'s",
	"Lock: latency added (locked − plain p50, sequential) ÷ `bench_floor_lock`'s",
	"Lock: Redis CPU per locked request ÷ floor (SET NX PX + owner-checked DEL script)",
	"Lock: Redlock of 3, throughput ÷ the single-server lock's",
	"Lock: Redlock of 3, Redis CPU per request on each server ÷ the single server's",
	"Lock: hot key, 1 Caddy, utilisation ÷ the in-process lock's through Caddy",
	"Lock: hot key, 2 Caddy, utilisation ÷ the in-process lock's through Caddy",
	"Lock: new Redis connections during steady load",
	"Lock: locked − plain p50, sequential, ÷ one Redis PING",
	"Rate limit sliding_window: throughput limited ÷ plain",
	"Rate limit sliding_window: Redis CPU per decision ÷ exact floor",
	"Rate limit sliding_window: Caddy CPU added ÷ plain request's",
	"Rate limit sliding_window: p50 latency added ÷ one Redis PING",
	"Rate limit gcra: throughput limited ÷ plain",
	"Rate limit gcra: Redis CPU per decision ÷ exact floor",
	"Rate limit gcra: Caddy CPU added ÷ plain request's",
	"Rate limit gcra: p50 latency added ÷ one Redis PING",
	"Rate limit: one hot key over three Caddy instances, the same four ratios",
	"Rate limit: windows beyond the algorithm's bound, load above the limit",
	"Rate limit: admitted ÷ n per window, 3 instances, one hot key, demand above n",
}

// costWithoutLeases is why the rows that need counted leases are not
// measured: every decision is one Redis round trip.
const costWithoutLeases = "not measured: counted leases are not built; every decision is a Redis round trip"

// The ratios of two samples of one round: a's throughput ÷ b's, the Caddy
// CPU a adds per request over b's (a plain load) ÷ b's, a's Redis CPU per
// operation ÷ b's.
func tputRatio(a, b costSample) float64 { return a.rate() / max(b.rate(), 1e-9) }

func caddyAddedRatio(a, b costSample) float64 {
	base := b.per(b.caddyCPU)
	return (a.per(a.caddyCPU) - base) / max(base, 1e-9)
}

func redisCPURatio(a, b costSample) float64 {
	return a.per(a.redisCPU) / max(b.per(b.redisCPU), 1e-9)
}

// costInputs are what the cost table is computed from: the loads of the
// lock and rate-limit rounds, the floor handlers measured in the same
// rounds, the sequential latencies, and the figures of the main part that
// the table divides (nil when it did not run: -only-cost).
type costInputs struct {
	plainL, lockedL, floorL    *costLoad // lock rounds: `respond`, redis_lock, the SET NX PX + DEL floor
	floor                      *floorHandlers
	seq                        []seqResult
	plainR, swL, gcraL, exactL *costLoad     // rate-limit rounds
	lockCost                   []lockCostRow // 1 server, then Redlock of 3
	hot                        []hotResult
}

// perRoundOf2 is, per round, f(a, b) ÷ f(c, d): a ratio of the plugin's
// (a against b) to a floor handler's (c against d) in the same round.
func perRoundOf2(a, b, c, d *costLoad, f func(a, b costSample) float64) []float64 {
	var out []float64
	for r := 0; r < len(a.samples) && r < len(b.samples) && r < len(c.samples) && r < len(d.samples); r++ {
		out = append(out, f(a.samples[r], b.samples[r])/max(f(c.samples[r], d.samples[r]), 1e-9))
	}
	return out
}

// costGoalsFrom turns the measured loads into the summary rows.
func costGoalsFrom(in costInputs) []costGoal {
	tput, caddyAdded, redisRatio := tputRatio, caddyAddedRatio, redisCPURatio
	med := func(l *costLoad, f func(costSample) float64) float64 { return median(perLoad(l, f)) }
	reqps := func(s costSample) float64 { return s.rate() }
	caddyUs := func(s costSample) float64 { return s.per(s.caddyCPU) }
	redisUs := func(s costSample) float64 { return s.per(s.redisCPU) }
	missing := func(figure, goal string, err error) costGoal {
		return costGoal{figure: figure, goal: goal, err: err}
	}
	fl := in.floor
	if fl == nil {
		fl = &floorHandlers{err: fmt.Errorf("not started")}
	}
	fig := costFigures
	var goals []costGoal

	// The lock against its floor handlers.
	if fl.err != nil {
		goals = append(goals, missing(fig[0], "≥ 0.9", fl.err), missing(fig[1], "≤ 1.5", fl.err), missing(fig[2], "≤ 1.3", fl.err))
	} else {
		goals = append(goals, ratioGoal(fig[0], perRoundOf2(in.lockedL, in.plainL, fl.lockB, fl.plainL, tput),
			fmt.Sprintf("redis_lock %.2f of its plain, %.0f req/s", median(perRound(in.lockedL, in.plainL, tput)), med(in.lockedL, reqps)),
			fmt.Sprintf("`bench_floor_lock batched`: %.2f of its plain, %.0f req/s", median(perRound(fl.lockB, fl.plainL, tput)), med(fl.lockB, reqps)), false, 0.9))
		// A ratio of the medians: the floor adds little, and a round's
		// ratio to its small, noisy figure swings (1.6 to 8.9 in one run).
		ours, floors := perRound(in.lockedL, in.plainL, caddyAdded), perRound(fl.lockB, fl.plainL, caddyAdded)
		gc := ratioGoal(fig[1], []float64{median(ours) / max(median(floors), 1e-9)},
			fmt.Sprintf("redis_lock adds %.2f × a plain request's Caddy CPU, rounds %s", median(ours), roundsText(ours, "%.2f")),
			fmt.Sprintf("`bench_floor_lock batched` adds %.2f ×, rounds %s", median(floors), roundsText(floors, "%.2f")), true, 1.5)
		gc.measured = strings.Replace(gc.measured, "; rounds ", "; the medians' ratio: ", 1)
		goals = append(goals, gc)
		g := costGoal{figure: fig[2], goal: "≤ 1.3"}
		plain, locked := seqNamed(in.seq, "plain"), seqNamed(in.seq, "locked")
		fplain, flocked := seqNamed(in.seq, "floor plain"), seqNamed(in.seq, "floor locked")
		for _, s := range []seqResult{plain, locked, fplain, flocked} {
			if s.err != nil && g.err == nil {
				g.err = fmt.Errorf("%s: %v", s.name, s.err)
			}
		}
		if g.err == nil {
			x := float64(locked.median-plain.median) / float64(max(flocked.median-fplain.median, 1))
			g.measured = fmt.Sprintf("**%.2f** (redis_lock %s − %s = %s; n %d)", x, ms(locked.median), ms(plain.median), ms(locked.median-plain.median), locked.n)
			g.reference = fmt.Sprintf("`bench_floor_lock` (SET NX PX before, the DEL script after): %s − %s = %s", ms(flocked.median), ms(fplain.median), ms(flocked.median-fplain.median))
			g.met = x <= 1.3
		}
		goals = append(goals, g)
	}
	goals = append(goals, ratioGoal(fig[3], perRound(in.lockedL, in.floorL, redisRatio),
		fmt.Sprintf("%.1f µs per locked request", med(in.lockedL, redisUs)),
		fmt.Sprintf("floor: %.1f µs Redis CPU per SET NX PX + DEL script (%.0f pairs/s)", med(in.floorL, redisUs), med(in.floorL, reqps)), true, 1.5))

	// Redlock against the single-server lock (the main part's lock cost).
	if len(in.lockCost) < 2 || in.lockCost[0].err != nil || in.lockCost[1].err != nil || in.lockCost[0].reqs == 0 || in.lockCost[1].reqs == 0 {
		err := fmt.Errorf("not measured (the main part's lock cost did not run, or failed)")
		goals = append(goals, missing(fig[4], "≥ 0.6", err), missing(fig[5], "≤ 1.2", err))
	} else {
		one, three := in.lockCost[0], in.lockCost[1]
		rate := func(r lockCostRow) float64 { return float64(r.reqs) / r.dur.Seconds() }
		perReq := func(r lockCostRow) float64 { return r.redisCPU / float64(r.reqs) * 1e6 }
		goals = append(goals, ratioGoal(fig[4], []float64{rate(three) / rate(one)},
			fmt.Sprintf("Redlock %.0f req/s", rate(three)), fmt.Sprintf("one server: %.0f req/s (one load of each, %d clients)", rate(one), *clients), false, 0.6))
		goals = append(goals, ratioGoal(fig[5], []float64{perReq(three) / perReq(one)},
			fmt.Sprintf("%.1f µs per request on each of the three", perReq(three)), fmt.Sprintf("one server: %.1f µs per request", perReq(one)), true, 1.2))
	}

	// The hot key against the in-process lock through the same Caddy.
	hotNamed := func(name string) (hotResult, bool) {
		for _, h := range in.hot {
			if h.name == name && h.err == nil && h.util > 0 {
				return h, true
			}
		}
		return hotResult{}, false
	}
	ceil, okCeil := hotNamed("hot-ceiling")
	for k, c := range []struct {
		name  string
		limit float64
	}{{"hot-caddy1", 0.97}, {"hot-caddy2", 0.90}} {
		h, ok := hotNamed(c.name)
		if !ok || !okCeil {
			goals = append(goals, missing(fig[6+k], "≥ "+strconv.FormatFloat(c.limit, 'f', -1, 64), fmt.Errorf("not measured (the main part's hot-key runs did not run, or failed)")))
			continue
		}
		goals = append(goals, ratioGoal(fig[6+k], []float64{h.util / ceil.util}, fmt.Sprintf("redis_lock %.2f", h.util), fmt.Sprintf("in-process lock through Caddy: %.2f", ceil.util), false, c.limit))
	}
	{
		g := costGoal{figure: fig[8], goal: "0", reference: "— (a count)"}
		var total, locked int64
		var per []string
		for r := range in.lockedL.samples {
			n := in.plainL.samples[r].conns + in.lockedL.samples[r].conns + in.floorL.samples[r].conns
			total += n
			locked += in.lockedL.samples[r].conns
			per = append(per, strconv.FormatInt(n, 10))
		}
		if len(in.lockedL.samples) == 0 {
			g.err = fmt.Errorf("no round measured")
		} else {
			g.measured = fmt.Sprintf("**%d** (%d during the locked loads; rounds %s)", total, locked, strings.Join(per, ", "))
			g.met = total == 0
		}
		goals = append(goals, g)
	}
	overPing := func(figure, name string, limit float64) costGoal {
		g := costGoal{figure: figure, goal: "—", noGoal: true}
		if limit > 0 {
			g.goal, g.noGoal = fmt.Sprintf("≤ %.1f", limit), false
		}
		plain, x, ping := seqNamed(in.seq, "plain"), seqNamed(in.seq, name), seqNamed(in.seq, "ping")
		for _, s := range []seqResult{plain, x, ping} {
			if s.err != nil && g.err == nil {
				g.err = fmt.Errorf("%s: %v", s.name, s.err)
			}
		}
		if g.err == nil {
			r := float64(x.median-plain.median) / float64(max(ping.median, 1))
			g.measured = fmt.Sprintf("**%.2f** (%s %s − `respond` %s = %s; n %d)", r, name, ms(x.median), ms(plain.median), ms(x.median-plain.median), x.n)
			g.reference = fmt.Sprintf("one PING (go-redis, to the lock's redis-server, sampled in the same rounds, each call after a `respond` request): p50 %s", ms(ping.median))
			g.met = limit > 0 && r <= limit
		}
		return g
	}
	goals = append(goals, overPing(fig[9], "locked", 0))

	// The rate limiter: the SPEC's goals are those of counted leases.
	for k, l := range []*costLoad{in.swL, in.gcraL} {
		f := fig[10+4*k:]
		goals = append(goals, ratioGoal(f[0], perRound(l, in.plainR, tput),
			fmt.Sprintf("limited %.0f req/s", med(l, reqps)),
			fmt.Sprintf("`respond` only: %.0f req/s", med(in.plainR, reqps)), false, 0.85))
		goals = append(goals, ratioGoal(f[1], perRound(l, in.exactL, redisRatio),
			fmt.Sprintf("%.1f µs per decision", med(l, redisUs)),
			fmt.Sprintf("exact floor, 25 decisions per script: %.1f µs Redis CPU per decision", med(in.exactL, redisUs)), true, 0.5))
		goals = append(goals, ratioGoal(f[2], perRound(l, in.plainR, caddyAdded),
			fmt.Sprintf("limited %.1f µs per request", med(l, caddyUs)),
			fmt.Sprintf("`respond` only: %.1f µs Caddy CPU per request", med(in.plainR, caddyUs)), true, 0.2))
		goals = append(goals, overPing(f[3], []string{"sliding_window", "gcra"}[k], 0.2))
	}
	goals = append(goals, missing(fig[18], "≥ 0.85 · ≤ 0.5 · ≤ 0.2 · ≤ 0.2", fmt.Errorf(costWithoutLeases)),
		missing(fig[19], "0", fmt.Errorf(costWithoutLeases)), missing(fig[20], "≥ 0.95", fmt.Errorf(costWithoutLeases)))
	return goals
}

package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	for _, c := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0},
		{[]float64{3}, 3},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		if got := median(c.in); got != c.want {
			t.Errorf("median(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}

// Every client gets its own keys, and together they use all n keys.
func TestLockKeyDisjointAndComplete(t *testing.T) {
	for _, tc := range []struct{ clients, n int }{{64, 1000}, {16, 1000}, {64, 64}, {3, 10}} {
		owner := map[int]int{}
		for c := 0; c < tc.clients; c++ {
			for i := 0; i < 3*tc.n; i++ {
				k := lockKey(c, i, tc.clients, tc.n)
				if k < 0 || k >= tc.n {
					t.Fatalf("%+v: client %d got key %d, outside [0, %d)", tc, c, k, tc.n)
				}
				if o, ok := owner[k]; ok && o != c {
					t.Fatalf("%+v: key %d used by clients %d and %d", tc, k, o, c)
				}
				owner[k] = c
			}
		}
		if len(owner) != tc.n {
			t.Errorf("%+v: %d keys used, want %d", tc, len(owner), tc.n)
		}
	}
}

func TestRatioGoalVerdict(t *testing.T) {
	g := ratioGoal("x", []float64{0.4, 0.6, 0.55}, "a", "b", false, 0.5)
	if !g.met || g.goal != "≥ 0.5" || !strings.HasPrefix(g.measured, "**0.55**") {
		t.Errorf("at least: %+v", g)
	}
	g = ratioGoal("x", []float64{2.1, 1.9, 2.5}, "a", "b", true, 2.0)
	if g.met || g.goal != "≤ 2" {
		t.Errorf("at most: %+v", g)
	}
	if g := ratioGoal("x", []float64{0.8}, "a", "b", false, 0.85); g.met || g.goal != "≥ 0.85" {
		t.Errorf("a goal of two decimals: %+v", g)
	}
	// A median that two decimals would round onto the goal shows three.
	g = ratioGoal("x", []float64{0.68, 0.71}, "a", "b", false, 0.7)
	if g.met || !strings.HasPrefix(g.measured, "**0.695**") {
		t.Errorf("at least, rounded onto the goal: %+v", g)
	}
	g = ratioGoal("x", []float64{0.40, 0.406}, "a", "b", true, 0.4)
	if g.met || !strings.HasPrefix(g.measured, "**0.403**") {
		t.Errorf("at most, rounded onto the goal: %+v", g)
	}
	if g := ratioGoal("x", nil, "a", "b", true, 1); g.err == nil || g.met {
		t.Errorf("no rounds: %+v", g)
	}
}

// The rows computed from synthetic rounds: per-round ratios, their median.
func TestCostGoalsFrom(t *testing.T) {
	s := func(ops int64, caddy, redis float64, conns int64) costSample {
		return costSample{ops: ops, dur: time.Second, caddyCPU: caddy, redisCPU: redis, conns: conns}
	}
	load := func(xs ...costSample) *costLoad { return &costLoad{samples: xs} }
	plainL := load(s(1000, 0.05, 0, 0), s(2000, 0.10, 0, 0))
	lockedL := load(s(600, 0.06, 0.060, 0), s(1000, 0.10, 0.100, 0)) // 0.6, 0.5; Caddy 100 µs vs 50: +1.0; Redis 100 µs
	floorL := load(s(2000, 0, 0.100, 0), s(2000, 0, 0.100, 0))       // 50 µs: ratio 2.0
	floor := &floorHandlers{
		plainL: load(s(1000, 0.04, 0, 0), s(1000, 0.04, 0, 0)),  // 40 µs
		lockB:  load(s(750, 0.045, 0, 0), s(625, 0.0375, 0, 0)), // 0.75, 0.625 (÷ → 0.8, 0.8); 60 µs: +0.5 (÷ → 2.0)
	}
	us := func(n int) time.Duration { return time.Duration(n) * time.Microsecond }
	seq := []seqResult{
		{name: "plain", median: us(400), n: 10},
		{name: "locked", median: us(700), n: 10},
		{name: "ping", median: us(200), n: 10},
		{name: "floor plain", median: us(300), n: 10},
		{name: "floor locked", median: us(500), n: 10},
		{name: "sliding_window", median: us(440), n: 10},
		{name: "gcra", median: us(500), n: 10},
	}
	plainR := load(s(1000, 0.05, 0, 0), s(1000, 0.05, 0, 0))
	lim := load(s(900, 0.054, 0.0018, 0), s(900, 0.054, 0.0018, 0)) // 0.9, Caddy +0.2, Redis 2 µs
	exact := load(s(1000, 0, 0.004, 0), s(1000, 0, 0.004, 0))       // 4 µs: 0.5
	costs := []lockCostRow{
		{name: "1", reqs: 1000, dur: time.Second, redisCPU: 0.020}, // 20 µs
		{name: "3", reqs: 500, dur: time.Second, redisCPU: 0.015},  // 0.5; 30 µs: 1.5
	}
	hot := []hotResult{{name: "hot-caddy1", util: 0.88}, {name: "hot-ceiling", util: 0.88}, {name: "hot-caddy2", util: 0.77}}
	goals := costGoalsFrom(costInputs{plainL: plainL, lockedL: lockedL, floorL: floorL, floor: floor, seq: seq,
		plainR: plainR, swL: lim, gcraL: lim, exactL: exact, lockCost: costs, hot: hot})
	if len(goals) != len(costFigures) {
		t.Fatalf("%d rows, want %d", len(goals), len(costFigures))
	}
	want := []struct {
		lead string
		met  bool
	}{
		{"**0.80**", false}, // (0.6 ÷ 0.75, 0.5 ÷ 0.625)
		{"**2.00**", false}, // Caddy added 1.0 ÷ the batched floor's 0.5
		{"**1.50**", false}, // (700 − 400) ÷ (500 − 300)
		{"**2.00**", false}, // Redis ÷ the SET NX PX + DEL floor
		{"**0.50**", false}, // Redlock throughput
		{"**1.50**", false}, // Redlock Redis CPU per server
		{"**1.00**", true},  // hot key, 1 Caddy
		{"**0.88**", false}, // hot key, 2 Caddy: 0.77 ÷ 0.88, against ≥ 0.90
		{"**0**", true},     // connections
		{"**1.50**", false}, // (700 − 400) ÷ 200, no verdict
		{"**0.90**", true},  // sliding_window throughput
		{"**0.50**", true},  // Redis ÷ exact floor
		{"**0.20**", true},  // Caddy added
		{"**0.20**", true},  // (440 − 400) ÷ 200
		{"**0.90**", true},  // gcra throughput
		{"**0.50**", true},
		{"**0.20**", true},
		{"**0.50**", false}, // (500 − 400) ÷ 200
	}
	for i, w := range want {
		g := goals[i]
		if g.err != nil || !strings.HasPrefix(g.measured, w.lead) || g.met != w.met {
			t.Errorf("row %d (%s): measured %q met %v err %v; want %s, met %v", i, g.figure, g.measured, g.met, g.err, w.lead, w.met)
		}
	}
	if !goals[9].noGoal || goals[10].noGoal {
		t.Error("only the lock's latency ÷ PING is printed without a verdict")
	}
	for _, g := range goals[len(want):] {
		if g.err == nil || g.met {
			t.Errorf("%s: measured %q without counted leases", g.figure, g.measured)
		}
	}
	// Without the main part (-only-cost) and without the floor handlers,
	// their rows say why, and the others stand.
	goals = costGoalsFrom(costInputs{plainL: plainL, lockedL: lockedL, floorL: floorL, floor: &floorHandlers{err: fmt.Errorf("no binary")}, seq: seq,
		plainR: plainR, swL: lim, gcraL: lim, exactL: exact})
	for i, g := range goals[:8] {
		if (g.err == nil) != (i == 3) {
			t.Errorf("row %d (%s) without the floor handlers and the main part: measured %q err %v", i, g.figure, g.measured, g.err)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	// user nice system idle iowait irq softirq steal guest guest_nice
	got := parseProcStat([]byte("cpu  100 5 20 300 10 1 4 60 7 0\ncpu0 50 2 10 150 5 0 2 30 3 0\n"))
	if want := (machineTicks{steal: 60, idle: 310, total: 500}); got != want {
		t.Fatalf("parseProcStat: %+v, want %+v", got, want)
	}
	if got := parseProcStat([]byte("intr 1 2 3\n")); got != (machineTicks{}) {
		t.Fatalf("a file without the cpu line: %+v, want zero", got)
	}
	d := machineTicks{steal: 80, idle: 400, total: 600}.minus(got)
	if d.share(d.steal) != 0.2 { // 20 of 100 ticks since the first reading
		t.Fatalf("share %v", d.share(d.steal))
	}
}

func TestMachineNote(t *testing.T) {
	l := &costLoad{samples: []costSample{
		{machine: machineTicks{steal: 10, idle: 20, total: 100}},
		{machine: machineTicks{steal: 30, idle: 0, total: 100}},
		{machine: machineTicks{steal: 20, idle: 10, total: 100}},
	}}
	if got, want := machineNote([]*costLoad{l}), "CPU steal over the measured loads (the hypervisor's share of this machine's CPU time) median 20 %, max 30 %; idle median 10 %"; got != want {
		t.Fatalf("machineNote:\n%s\nwant\n%s", got, want)
	}
	if got := machineNote([]*costLoad{{}}); got != "machine CPU unknown (no /proc/stat)" {
		t.Fatalf("no samples: %q", got)
	}
}

// A spacer goes before every target in every round, but is never measured
// or returned; the measured targets keep their order.
func TestInterleavedSpacer(t *testing.T) {
	var calls []string
	call := func(name string) func(context.Context) error {
		return func(context.Context) error { calls = append(calls, name); return nil }
	}
	ts := spaced("", latTarget{name: "a", do: call("a")}, latTarget{name: "b", do: call("b")})
	for i := range ts {
		if ts[i].spacer {
			ts[i].do = call("s")
		}
	}
	seq := interleaved(ts, 3, time.Minute)
	if len(seq) != 2 || seq[0].name != "a" || seq[1].name != "b" || seq[0].n != 3 || seq[1].n != 3 {
		t.Fatalf("results %+v, want a and b with 3 samples each", seq)
	}
	if got, want := strings.Join(calls, ","), "s,a,s,b,s,a,s,b,s,a,s,b"; got != want {
		t.Fatalf("calls %s, want %s", got, want)
	}
	if s := seqNamed(seq, "spacer"); s.err == nil {
		t.Fatalf("the spacer was returned: %+v", s)
	}
}

// The latency row's floors are read as PINGs of the same rounds, and the
// rest of the locked request is what the acquire script's round trip does
// not explain; a floor that was not measured says so.
func TestAcquireFloorNote(t *testing.T) {
	r := func(name string, us int) seqResult {
		return seqResult{name: name, n: 10, median: time.Duration(us) * time.Microsecond, errs: &errCount{}}
	}
	seq := []seqResult{r("plain", 200), r("ping", 100), r("locked", 450), r("set nx", 110), r("acquire script", 140)}
	got := acquireFloorNote(seq)
	for _, want := range []string{"**1.10** PINGs (the one-command lock)", "**1.40** PINGs", "Of the locked request's 2.50 PINGs, 1.40 are", "the rest (1.10)"} {
		if !strings.Contains(got, want) {
			t.Errorf("note %q lacks %q", got, want)
		}
	}
	if got := acquireFloorNote(seq[:3]); !strings.HasPrefix(got, "✘") || !strings.Contains(got, "acquire script: not measured") {
		t.Errorf("without the floors: %q", got)
	}
}

// The floor handlers' note divides each floor load by its own Caddy's
// plain load of the same round (not the plugin's), puts the plugin's
// figure beside it, and says when the floor handlers did not run.
func TestFloorHandlerNote(t *testing.T) {
	s := func(ops int64, caddy, redis float64) costSample {
		return costSample{ops: ops, dur: time.Second, caddyCPU: caddy, redisCPU: redis}
	}
	load := func(x costSample) *costLoad { return &costLoad{samples: []costSample{x}} }
	f := &floorHandlers{
		plainL: load(s(2000, 0.08, 0)),      // 40 µs
		lockL:  load(s(800, 0.08, 0.032)),   // 0.40, 100 µs: +1.50, Redis 40 µs
		lockB:  load(s(1000, 0.07, 0.030)),  // 0.50, 70 µs: +0.75
		plainR: load(s(2000, 0.08, 0)),      // 40 µs
		limitL: load(s(1000, 0.08, 0.010)),  // 0.50, +1.00, Redis 10 µs
		limitB: load(s(1400, 0.07, 0.0028)), // 0.70, 50 µs: +0.25, Redis 2 µs
	}
	plainL := load(s(1000, 0.05, 0))      // 50 µs (the plugin's Caddy)
	lockedL := load(s(450, 0.05, 0.0135)) // 0.45, 111 µs: +1.22, Redis 30 µs
	lockFloor := load(s(1000, 0, 0.020))  // 20 µs
	plainR := load(s(1000, 0.05, 0))
	swL := load(s(600, 0.045, 0.006))    // 0.60, 75 µs: +0.50, Redis 10 µs
	gcraL := load(s(700, 0.049, 0.0056)) // 0.70, 70 µs: +0.40, Redis 8 µs
	exactL := load(s(1000, 0, 0.002))    // 2 µs
	us := func(n int) time.Duration { return time.Duration(n) * time.Microsecond }
	seq := []seqResult{
		{name: "plain", median: us(200), n: 10}, {name: "ping", median: us(100), n: 10}, {name: "locked", median: us(450), n: 10},
		{name: "floor plain", median: us(210), n: 10}, {name: "floor locked", median: us(380), n: 10},
	}
	got := f.note(plainL, lockedL, lockFloor, seq, plainR, swL, gcraL, exactL)
	for _, want := range []string{
		"throughput ÷ plain **0.40** (rounds 0.40; the plugin's 0.45)",
		"Caddy CPU added ÷ plain **1.50** (rounds 1.50; the plugin's 1.22)",
		"Redis CPU ÷ the lock floor **2.00** (rounds 2.00; the plugin's 1.50)",
		"locked − plain p50 ÷ PING **1.70** (the plugin's 2.50)",
		"Batched (the commands of concurrent requests share pipelines, one worker): throughput ÷ plain **0.50**",
		"Caddy CPU added ÷ plain **0.75**",
		"throughput ÷ plain **0.50** (rounds 0.50; the plugin's sliding_window 0.60, gcra 0.70); Caddy CPU added ÷ plain **1.00** (rounds 1.00; the plugin's sliding_window 0.50, gcra 0.40); Redis CPU ÷ the exact floor **5.00** (rounds 5.00; the plugin's sliding_window 5.00, gcra 4.00)",
		"throughput ÷ plain **0.70** (rounds 0.70; the plugin's sliding_window 0.60, gcra 0.70); Caddy CPU added ÷ plain **0.25**",
		"Redis CPU ÷ the exact floor **1.00**",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("note lacks %q:\n%s", want, got)
		}
	}
	if got := (&floorHandlers{err: fmt.Errorf("no binary")}).note(plainL, lockedL, lockFloor, seq, plainR, swL, gcraL, exactL); got != "✘ the floor handlers (bench/benchfloor): no binary" {
		t.Errorf("without the floor handlers: %q", got)
	}
}

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testclock"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// fakeClock is a Clock that moves only when a test moves it.
type fakeClock = testclock.Fake

func newFakeClock() *fakeClock { return testclock.New() }

// The faults faultClient injects into a pipeline.
const (
	faultNone     int32 = iota
	faultDown           // nothing is sent; every command fails as unreachable
	faultLostRead       // the pipeline runs in Redis, then its answers are lost
)

// errLost is what a command gets whose answer faultClient dropped.
var errLost = io.ErrUnexpectedEOF

// faultClient wraps a real client and injects what a real Redis cannot
// (an answer lost after the write); it counts the pipelines sent.
type faultClient struct {
	Client
	fault atomic.Int32
	execs atomic.Int32 // pipelines that reached Redis
}

func (f *faultClient) Pipeline() redis.Pipeliner {
	return &faultPipe{Pipeliner: f.Client.Pipeline(), f: f}
}

type faultPipe struct {
	redis.Pipeliner
	f *faultClient
}

func (p *faultPipe) Exec(ctx context.Context) ([]redis.Cmder, error) {
	cmds := p.Cmds()
	switch p.f.fault.Load() {
	case faultDown:
		p.Discard()
		for _, c := range cmds {
			c.SetErr(errLost)
		}
		return cmds, errLost
	case faultLostRead:
		p.f.execs.Add(1)
		_, _ = p.Pipeliner.Exec(ctx)
		for _, c := range cmds {
			c.SetErr(errLost)
		}
		return cmds, errLost
	}
	p.f.execs.Add(1)
	return p.Pipeliner.Exec(ctx)
}

// countObserver counts the breaker's changes.
type countObserver struct{ opened, closed atomic.Int32 }

func (o *countObserver) BreakerOpened(int) { o.opened.Add(1) }
func (o *countObserver) BreakerClosed()    { o.closed.Add(1) }

// slidingCall is one decision of 1 per call on a sliding_window rate of n
// per minute for key.
func slidingCall(key string, n int) *Call {
	return &Call{script: slidingScript, keys: []string{key}, argv: []any{1, 0, 0, n, time.Minute.Microseconds()}}
}

// faultyBatcher is a batcher with one worker on a fake clock, over a
// faultClient of a redis-server of its own, and the observer of its breaker.
func faultyBatcher(t *testing.T) (*testredis.Server, *faultClient, *fakeClock, *Batcher, *countObserver) {
	t.Helper()
	r := testredis.Start(t)
	f := &faultClient{Client: r.Client()}
	clock := newFakeClock()
	b := NewBatcher(f, Options{Workers: 1, Clock: clock})
	t.Cleanup(b.Close)
	return r, f, clock, b, &countObserver{}
}

// TestBatcherLostAnswer: a pipeline whose answer is lost after Redis ran it
// makes each of its calls an error, never an answer and never sent again:
// every lost decision was counted once in Redis, none twice. Lost answers
// count for the breaker like an unreachable Redis: after BreakerThreshold of
// them calls are refused without Redis; on the fake clock, a probe goes
// through a second later and closes the breaker.
func TestBatcherLostAnswer(t *testing.T) {
	t.Parallel()
	r, f, clock, b, obs := faultyBatcher(t)
	ctx := context.Background()
	const key, n = "t:{lost}:sw", 10
	// Loaded, so that EVALSHA runs (a NOSCRIPT answer lost would hide the
	// EVAL the batcher sends next).
	if err := r.Client().ScriptLoad(ctx, slidingScript.Source()).Err(); err != nil {
		t.Fatal(err)
	}

	f.fault.Store(faultLostRead)
	for i := 0; i < BreakerThreshold; i++ {
		c := slidingCall(key, n)
		if err := b.Do(ctx, c, 5*time.Second, obs); !errors.Is(err, errLost) || c.res != nil {
			t.Fatalf("lost answer %d: %v %v, want no answer and the transport error", i, c.res, err)
		}
	}
	if execs := f.execs.Load(); execs != BreakerThreshold {
		t.Fatalf("%d pipelines reached Redis for %d calls whose answers were lost, want one each (never resent)", execs, BreakerThreshold)
	}
	if !b.BreakerOpen() || obs.opened.Load() != 1 {
		t.Fatalf("breaker open %v, opened %d times, after %d lost answers; want open once", b.BreakerOpen(), obs.opened.Load(), BreakerThreshold)
	}
	if err := b.Do(ctx, slidingCall(key, n), 5*time.Second, obs); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("call on an open breaker: %v, want ErrBreakerOpen", err)
	}
	clock.Advance(999 * time.Millisecond)
	if err := b.Do(ctx, slidingCall(key, n), 5*time.Second, obs); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("call 999ms after the breaker opened: %v, want ErrBreakerOpen", err)
	}
	if execs := f.execs.Load(); execs != BreakerThreshold {
		t.Fatalf("an open breaker let %d pipelines through", execs-BreakerThreshold)
	}

	f.fault.Store(faultNone)
	clock.Advance(time.Millisecond)
	c := slidingCall(key, n)
	err := b.Do(ctx, c, 5*time.Second, obs)
	res := c.res
	if err != nil {
		t.Fatalf("the probe a second later: %v", err)
	}
	d, err := parseDecision(res, 1, decisionScripts[slidingScript])
	if err != nil {
		t.Fatal(err)
	}
	// The lost decisions were each counted once: 10 - 3 - this one.
	if want := int64(n - BreakerThreshold - 1); !d.Allowed || d.Remaining != want {
		t.Fatalf("after %d lost answers: %+v, want admitted with %d left", BreakerThreshold, d, want)
	}
	if b.BreakerOpen() || obs.closed.Load() != 1 {
		t.Fatalf("breaker open %v, closed %d times after a good probe; want closed once", b.BreakerOpen(), obs.closed.Load())
	}
}

// TestBatcherBreakerProbes: an open breaker answers without Redis and lets
// one call through about once a second (a fake clock: no sleep); a failed
// probe keeps it open for another second.
func TestBatcherBreakerProbes(t *testing.T) {
	t.Parallel()
	_, f, clock, b, obs := faultyBatcher(t)
	ctx := context.Background()
	call := func() error {
		err := b.Do(ctx, slidingCall("t:{probe}:sw", 100), 5*time.Second, obs)
		return err
	}

	f.fault.Store(faultDown)
	for i := 0; i < BreakerThreshold-1; i++ {
		if err := call(); !errors.Is(err, errLost) {
			t.Fatalf("call %d to a Redis that is down: %v", i, err)
		}
	}
	if b.BreakerOpen() {
		t.Fatal("breaker opened before the threshold")
	}
	if err := call(); !errors.Is(err, errLost) || !b.BreakerOpen() {
		t.Fatalf("failure %d: %v, breaker open %v; want open", BreakerThreshold, err, b.BreakerOpen())
	}
	for _, step := range []time.Duration{0, 999 * time.Millisecond} {
		clock.Advance(step)
		if err := call(); !errors.Is(err, ErrBreakerOpen) {
			t.Fatalf("%s after opening: %v, want ErrBreakerOpen", step, err)
		}
	}
	clock.Advance(time.Millisecond)
	if err := call(); !errors.Is(err, errLost) {
		t.Fatalf("the probe a second later: %v, want it sent (and failing)", err)
	}
	if err := call(); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("a second call in the probe's second: %v, want ErrBreakerOpen", err)
	}
	f.fault.Store(faultNone)
	clock.Advance(time.Second)
	if err := call(); err != nil || b.BreakerOpen() {
		t.Fatalf("a good probe: %v, breaker open %v; want closed", err, b.BreakerOpen())
	}
	if err := call(); err != nil {
		t.Fatalf("after the breaker closed: %v", err)
	}
	if obs.opened.Load() != 1 || obs.closed.Load() != 1 {
		t.Fatalf("observer told of %d openings and %d closings, want 1 and 1", obs.opened.Load(), obs.closed.Load())
	}
}

// TestFailureCodesAgreeWithScripts: the codes of a failed decision in a
// batch are named once in Go (failedRead, failedRun) and written into the
// decision scripts: a real Redis answers exactly those numbers, for a
// decision that failed before writing (its key is a list) and one that
// failed while writing (Redis refuses writes).
func TestFailureCodesAgreeWithScripts(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := r.Client()
	ctx := context.Background()
	if err := c.RPush(ctx, "t:{bad}:sw", "x").Err(); err != nil {
		t.Fatal(err)
	}
	gcra := func(key string) *Call {
		return &Call{script: gcraScript, keys: []string{key}, argv: []any{1, 0, 0, 5, time.Minute.Microseconds(), 5}}
	}
	for _, tc := range []struct {
		name  string
		calls []*Call
		oom   bool
		want  int64 // the answer of the last decision
	}{
		{"sliding, read fails", []*Call{slidingCall("t:{a}:sw", 5), slidingCall("t:{bad}:sw", 5)}, false, failedRead},
		{"gcra, read fails", []*Call{gcra("t:{a}:g"), gcra("t:{bad}:sw")}, false, failedRead},
		{"sliding, write fails", []*Call{slidingCall("t:{b}:sw", 5), slidingCall("t:{c}:sw", 5)}, true, failedRun},
		{"gcra, write fails", []*Call{gcra("t:{b}:g"), gcra("t:{c}:g")}, true, failedRun},
	} {
		if tc.oom {
			if err := c.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
				t.Fatal(err)
			}
		}
		u := &rlUnit{calls: tc.calls, batch: true}
		vals, err := c.Do(ctx, u.command(byText)...).Int64Slice()
		if tc.oom {
			if err := c.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
				t.Fatal(err)
			}
		}
		if err != nil || !u.answer(vals) {
			t.Fatalf("%s: %v %v", tc.name, vals, err)
		}
		last := tc.calls[len(tc.calls)-1].res
		if last[0] != tc.want || last[1] != 0 {
			t.Fatalf("%s: the failed decision answered %v, want %d then zeros", tc.name, last, tc.want)
		}
		for _, v := range last[2:] {
			if v != 0 {
				t.Fatalf("%s: the failed decision answered %v, want %d then zeros", tc.name, last, tc.want)
			}
		}
	}
}

// TestBanInBatch: decisions of limits that ban and limits that do not, in
// one script call: a rejection by the quota starts the key's ban (its ban
// key expires with the ban) and answers BanStarted with the ban as its
// wait; the key's next decision is refused by the ban (Banned, all its
// rates rejecting, the ban's rest as wait) without reading its rates; a
// limit without a ban rejects as before and writes no ban.
func TestBanInBatch(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	b := NewBatcher(r.Client(), Options{})
	defer b.Close()
	const ban = 60_000 // ms
	w := time.Minute.Microseconds()
	banning := []any{1, 0, ban, 1, w, 5, w} // two rates: 1 and 5 a minute
	plain := []any{1, 0, 0, 1, w}
	call := func(argv []any, id string) *Call {
		c := &Call{script: slidingScript, keys: []string{"t:{" + id + "}:sw:1", "t:{" + id + "}:sw:5"}, argv: argv}
		if argv[2] != 0 {
			c.banKey = "t:{" + id + "}:ban"
		} else {
			c.keys = c.keys[:1]
		}
		return c
	}
	calls := []*Call{call(banning, "x"), call(plain, "y"), call(banning, "x"), call(plain, "y"), call(banning, "x")}
	b.SendNow(calls)
	var ds []Decision
	for i, c := range calls {
		<-c.Done()
		d, err := parseDecision(c.res, len(c.keys), decisionScripts[slidingScript])
		if c.err != nil || err != nil {
			t.Fatalf("decision %d: %v %v", i, c.err, err)
		}
		ds = append(ds, d)
	}
	if !ds[0].Allowed || !ds[1].Allowed {
		t.Fatalf("first decisions: %+v %+v, want both admitted", ds[0], ds[1])
	}
	if d := ds[2]; d.Allowed || d.Ban != BanStarted || d.Wait != ban*time.Millisecond || d.Tight != 0 {
		t.Fatalf("rejection by the quota of a banning limit: %+v, want BanStarted with a wait of the ban, by rate 0", d)
	}
	if d := ds[3]; d.Allowed || d.Ban != NotBanned || d.Wait > time.Minute {
		t.Fatalf("rejection of a limit without ban: %+v, want NotBanned within the window", d)
	}
	if d := ds[4]; d.Allowed || d.Ban != Banned || d.Wait <= 59*time.Second || d.Wait > ban*time.Millisecond || d.Remaining != 0 {
		t.Fatalf("a banned key: %+v, want Banned with the ban's rest as wait", d)
	}
	// Refused without reading its rates: every rate answers rejecting.
	if res := calls[4].res; res[2] != -1 || res[4] != -1 {
		t.Fatalf("a banned decision's rates: %v, want -1 (rejecting) on each", res)
	}
	ctx := context.Background()
	if ttl := r.Client().PTTL(ctx, "t:{x}:ban").Val(); ttl <= 59*time.Second || ttl > time.Minute {
		t.Fatalf("ban key expires in %s, want the ban's minute", ttl)
	}
	if n := r.Client().Exists(ctx, "t:{y}:ban").Val(); n != 0 {
		t.Fatal("a limit without ban wrote a ban")
	}
	// The ban did not charge the rates: rate 1 (5 a minute) holds one admission.
	if got, _ := r.Client().GetRange(ctx, "t:{x}:sw:5", 0, 7).Bytes(); len(got) != 8 || got[0] != 0x3f || got[1] != 0xf0 {
		t.Fatalf("rate 1's log header %x, want pos 1.0 (one admission recorded)", got)
	}
}

// TestBanOutOfMemory: a Redis that refuses writes still rejects a request
// its quota rejects, without a ban (never an error that the fail policy
// could turn into an admission).
func TestBanOutOfMemory(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := r.Client()
	b := NewBatcher(c, Options{})
	defer b.Close()
	ctx := context.Background()
	call := func() *Call {
		return &Call{script: gcraScript, keys: []string{"t:{oom}:g"}, banKey: "t:{oom}:ban", argv: []any{1, 0, 60_000, 1, time.Minute.Microseconds(), 1}}
	}
	decide := func() (Decision, error) {
		cl := call()
		b.SendNow([]*Call{cl})
		<-cl.Done()
		if cl.err != nil {
			return Decision{}, cl.err
		}
		return parseDecision(cl.res, 1, decisionScripts[gcraScript])
	}
	if d, err := decide(); err != nil || !d.Allowed {
		t.Fatalf("first decision: %+v %v", d, err)
	}
	if err := c.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	defer c.ConfigSet(ctx, "maxmemory", "0")
	d, err := decide()
	if err != nil || d.Allowed || d.Ban != NotBanned || d.Wait <= 0 {
		t.Fatalf("a rejection while Redis refuses writes: %+v %v, want rejected without a ban", d, err)
	}
	if n := c.Exists(ctx, "t:{oom}:ban").Val(); n != 0 {
		t.Fatal("a ban was written while Redis refused writes")
	}
}

// TestIndexInBatch: in one script call, decisions of sets that index (both
// algorithms, with and without a ban) record their admitted rate states in
// the key's index, scored by each state's expiry and expiring with the
// latest; a rejection records nothing new; a set that does not index, with
// the same arguments, writes no index.
func TestIndexInBatch(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	b := NewBatcher(r.Client(), Options{})
	defer b.Close()
	ctx := context.Background()
	c := r.Client()
	for n, algo := range []struct {
		script *redisconn.Script
		argv   []any // two rates: 2 a second and 5 a minute
	}{
		{slidingScript, []any{1, 0, 0, 2, time.Second.Microseconds(), 5, time.Minute.Microseconds()}},
		{gcraScript, []any{1, 0, 0, 2, time.Second.Microseconds(), 2, 5, time.Minute.Microseconds(), 5}},
		{slidingScript, []any{1, 0, 60_000, 2, time.Second.Microseconds(), 5, time.Minute.Microseconds()}},
	} {
		p := fmt.Sprintf("i%d:", n)
		call := func(id string, index bool) *Call {
			c := &Call{script: algo.script, keys: []string{p + "{" + id + "}:a", p + "{" + id + "}:b"}, argv: algo.argv}
			if algo.argv[2] != 0 {
				c.banKey = p + "{" + id + "}:ban"
			}
			if index {
				c.indexKey = p + "{" + id + "}:rates"
			}
			return c
		}
		calls := []*Call{call("x", true), call("y", false), call("x", true), call("y", false), call("x", true)}
		b.SendNow(calls)
		for i, c := range calls {
			<-c.Done()
			d, err := parseDecision(c.res, len(c.keys), decisionScripts[algo.script])
			if c.err != nil || err != nil || d.Allowed != (i < 4) {
				t.Fatalf("%s decision %d: %+v %v %v, want the first two of each key admitted", p, i, d, c.err, err)
			}
		}
		index := p + "{x}:rates"
		zs, err := c.ZRangeWithScores(ctx, index, 0, -1).Result()
		if err != nil || len(zs) != 2 {
			t.Fatalf("%s index %v (%v), want both rates", p, zs, err)
		}
		for _, z := range zs {
			key := z.Member.(string)
			at := c.PExpireTime(ctx, key).Val() // ms since the epoch
			if math.Abs(z.Score-float64(at.Milliseconds())) > 1 {
				t.Errorf("%s %s scored %v, its state expires at %d", p, key, z.Score, at.Milliseconds())
			}
		}
		ttl := c.PTTL(ctx, index).Val()
		if long := c.PTTL(ctx, p+"{x}:b").Val(); long <= time.Second || ttl < long || ttl > time.Minute+time.Second {
			t.Errorf("%s index expires in %s, its longest state in %s: want the index with it", p, ttl, long)
		}
		if n := c.Exists(ctx, p+"{y}:rates").Val(); n != 0 {
			t.Errorf("%s a set that does not index wrote an index", p)
		}
	}
}

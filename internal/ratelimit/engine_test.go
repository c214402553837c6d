package ratelimit

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// fakeClock is a Clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

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
	return &Call{Script: SlidingScript, Keys: []string{key}, Argv: []any{1, 0, n, time.Minute.Microseconds()}}
}

// TestBatcherLostAnswer: a pipeline whose answer is lost after Redis ran it
// makes each of its calls an error, never an answer and never sent again:
// every lost decision was counted once in Redis, none twice. Lost answers
// count for the breaker like an unreachable Redis: after BreakerThreshold of
// them calls are refused without Redis; on the fake clock, a probe goes
// through a second later and closes the breaker.
func TestBatcherLostAnswer(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	f := &faultClient{Client: r.Client()}
	clock := newFakeClock()
	b := NewBatcher(f, Options{Workers: 1, Clock: clock})
	defer b.Close()
	obs := &countObserver{}
	ctx := context.Background()
	const key, n = "t:{lost}:sw", 10
	// Loaded, so that EVALSHA runs (a NOSCRIPT answer lost would hide the
	// EVAL the batcher sends next).
	if err := r.Client().ScriptLoad(ctx, SlidingScript.Source()).Err(); err != nil {
		t.Fatal(err)
	}

	f.fault.Store(faultLostRead)
	for i := 0; i < BreakerThreshold; i++ {
		if res, err := b.Do(ctx, slidingCall(key, n), 5*time.Second, obs); !errors.Is(err, errLost) || res != nil {
			t.Fatalf("lost answer %d: %v %v, want no answer and the transport error", i, res, err)
		}
	}
	if execs := f.execs.Load(); execs != BreakerThreshold {
		t.Fatalf("%d pipelines reached Redis for %d calls whose answers were lost, want one each (never resent)", execs, BreakerThreshold)
	}
	if !b.BreakerOpen() || obs.opened.Load() != 1 {
		t.Fatalf("breaker open %v, opened %d times, after %d lost answers; want open once", b.BreakerOpen(), obs.opened.Load(), BreakerThreshold)
	}
	if _, err := b.Do(ctx, slidingCall(key, n), 5*time.Second, obs); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("call on an open breaker: %v, want ErrBreakerOpen", err)
	}
	clock.Advance(999 * time.Millisecond)
	if _, err := b.Do(ctx, slidingCall(key, n), 5*time.Second, obs); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("call 999ms after the breaker opened: %v, want ErrBreakerOpen", err)
	}
	if execs := f.execs.Load(); execs != BreakerThreshold {
		t.Fatalf("an open breaker let %d pipelines through", execs-BreakerThreshold)
	}

	f.fault.Store(faultNone)
	clock.Advance(time.Millisecond)
	res, err := b.Do(ctx, slidingCall(key, n), 5*time.Second, obs)
	if err != nil {
		t.Fatalf("the probe a second later: %v", err)
	}
	d, err := ParseDecision(res, 1, PerRate(SlidingScript))
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
	r := testredis.Start(t)
	f := &faultClient{Client: r.Client()}
	clock := newFakeClock()
	b := NewBatcher(f, Options{Workers: 1, Clock: clock})
	defer b.Close()
	obs := &countObserver{}
	ctx := context.Background()
	call := func() error {
		_, err := b.Do(ctx, slidingCall("t:{probe}:sw", 100), 5*time.Second, obs)
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
		return &Call{Script: GCRAScript, Keys: []string{key}, Argv: []any{1, 0, 5, time.Minute.Microseconds(), 5}}
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
		last := tc.calls[len(tc.calls)-1].Res
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

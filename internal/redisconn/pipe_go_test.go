package redisconn

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// spawner starts the goroutines a pipe asks for calls nobody waits for,
// counts them, and recovers (and keeps) what panics in them, as a Sender's
// spawn must.
type spawner struct {
	n      atomic.Int32
	mu     sync.Mutex
	panics []any
	pipe   *Pipe       // if set, spawn takes its mutex first: it must not be held
	locked atomic.Bool // the pipe's mutex was held for 5s while it asked for a goroutine
}

func (s *spawner) spawn(f func()) {
	s.n.Add(1)
	if s.pipe != nil {
		free := make(chan struct{})
		go func() { s.pipe.Queued(); close(free) }()
		select {
		case <-free:
		case <-time.After(5 * time.Second):
			s.locked.Store(true) // asked under the mutex: a spawn that waits for it would deadlock
		}
	}
	go func() {
		defer func() {
			if r := recover(); r != nil {
				s.mu.Lock()
				s.panics = append(s.panics, r)
				s.mu.Unlock()
			}
		}()
		f()
	}()
}

func (s *spawner) recovered() []any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]any(nil), s.panics...)
}

// goCall sends countScript on key through p without waiting; the answer
// (or error) arrives on the returned channel, and n counts the calls of
// done (exactly one is due).
func goCall(p Sender, key string, s *spawner, n *atomic.Int32) <-chan *redis.Cmd {
	out := make(chan *redis.Cmd, 2)
	countScript.Go(p, countScript.Argv(nil, []string{key}), s.spawn, func(cmd *redis.Cmd) {
		n.Add(1)
		out <- cmd
	})
	return out
}

func answered(t *testing.T, ch <-chan *redis.Cmd) *redis.Cmd {
	t.Helper()
	select {
	case cmd := <-ch:
		return cmd
	case <-time.After(10 * time.Second):
		t.Fatal("a call nobody waits for was never answered")
		return nil
	}
}

// idle waits until p has no pipeline on its way and nothing queued.
func idle(t *testing.T, p *Pipe) {
	t.Helper()
	if !waitUntil(func() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.inflight == 0 && len(p.queue) == 0 }) {
		t.Fatal("the pipe never went idle: a pipeline in flight was never ended")
	}
}

// doneOnce checks that each call's done ran exactly once.
func doneOnce(t *testing.T, n *atomic.Int32, calls int) {
	t.Helper()
	time.Sleep(50 * time.Millisecond) // a second done would come now
	if got := n.Load(); got != int32(calls) {
		t.Fatalf("done ran %d times for %d calls, want once each", got, calls)
	}
}

// TestPipeGoAloneLeavesAtOnce: on an idle pipe, a call nobody waits for
// leaves at once, as a plain call, on a goroutine the pipe starts (not its
// caller's), and done gets its answer.
func TestPipeGoAloneLeavesAtOnce(t *testing.T) {
	t.Parallel()
	c, _ := newPipeClient(t)
	var p Pipe
	var s spawner
	var n atomic.Int32
	ch := goCall(p.Via(c, 5*time.Second), "alone", &s, &n)
	if v, err := answered(t, ch).Int64(); err != nil || v != 1 {
		t.Fatalf("answer %d, %v; want 1", v, err)
	}
	if s.n.Load() != 1 || c.lone.Load() != 1 {
		t.Fatalf("%d goroutines started, %d lone calls; want 1 and 1", s.n.Load(), c.lone.Load())
	}
	idle(t, &p)
	doneOnce(t, &n, 1)
}

// TestPipeGoRidesWithWaitingCalls: calls nobody waits for that arrive
// while PipeInFlight pipelines are on their way start no goroutine: they
// leave in the pipeline a waiting caller sends, and their done runs on one
// goroutine started for all of them, after the waiting callers are
// answered.
func TestPipeGoRidesWithWaitingCalls(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	var s spawner
	var n atomic.Int32
	var wg sync.WaitGroup
	const waiting, detached = 3, 6
	errs := make([]error, waiting)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = countScript.Run(context.Background(), p.Via(c, 5*time.Second), []string{"ride"}).Err()
		}()
	}
	if !waitUntil(func() bool { return p.Queued() == waiting }) {
		t.Fatalf("%d calls queued, want %d", p.Queued(), waiting)
	}
	chs := make([]<-chan *redis.Cmd, detached)
	for i := range chs {
		chs[i] = goCall(p.Via(c, 5*time.Second), "ride", &s, &n)
	}
	if p.Queued() != waiting+detached || s.n.Load() != 0 {
		t.Fatalf("%d calls queued, %d goroutines started; want %d and 0", p.Queued(), s.n.Load(), waiting+detached)
	}
	c.hold <- struct{}{} // one held call returns: its pipeline hands the queue on to a waiting caller
	wg.Wait()
	seen := map[int64]bool{}
	for _, ch := range chs {
		v, err := answered(t, ch).Int64()
		if err != nil || seen[v] {
			t.Fatalf("answer %d, %v (each call its own count)", v, err)
		}
		seen[v] = true
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("waiting call %d: %v", i, err)
		}
	}
	if sizes := c.batchSizes(); len(sizes) != 1 || sizes[0] != waiting+detached {
		t.Fatalf("pipelines of %v, want one of %d", sizes, waiting+detached)
	}
	if got := s.n.Load(); got != 1 {
		t.Fatalf("%d goroutines started, want 1 (for the done of the pipeline's calls nobody waits for)", got)
	}
	close(c.hold)
	held.Wait()
	idle(t, p)
	doneOnce(t, &n, detached)
}

// TestPipeGoQueuedAloneIsSent: calls nobody waits for, queued behind the
// pipelines on their way with no waiting caller to send them, leave once a
// pipeline is answered (a goroutine the pipe starts leads them).
func TestPipeGoQueuedAloneIsSent(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	s := spawner{pipe: p}
	var n atomic.Int32
	const calls = 5
	chs := make([]<-chan *redis.Cmd, calls)
	for i := range chs {
		chs[i] = goCall(p.Via(c, 5*time.Second), "queued", &s, &n)
	}
	if s.n.Load() != 0 {
		t.Fatalf("%d goroutines started for queued calls, want 0", s.n.Load())
	}
	if p.Queued() != calls {
		t.Fatalf("%d calls queued, want %d", p.Queued(), calls)
	}
	close(c.hold)
	held.Wait()
	for i, ch := range chs {
		if err := answered(t, ch).Err(); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if v := c.Client.Get(context.Background(), "queued").Val(); v != "5" {
		t.Fatalf("redis ran the calls %s times, want 5", v)
	}
	if s.locked.Load() {
		t.Fatal("the pipe asked for a goroutine while holding its mutex")
	}
	idle(t, p)
	doneOnce(t, &n, calls)
}

// TestPipeGoLostAndExpired: a call nobody waits for gets its pipeline's
// lost answer (never resent), and one whose deadline passed in the queue
// gets context.DeadlineExceeded, unsent.
func TestPipeGoLostAndExpired(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	c.loseAll.Store(true)
	var s spawner
	var n atomic.Int32
	// The short call stands between the two others: whichever leads, it
	// is taken from the queue (or handed the lead) after its deadline.
	lost := []<-chan *redis.Cmd{goCall(p.Via(c, 5*time.Second), "lost", &s, &n)}
	short := goCall(p.Via(c, 100*time.Millisecond), "short", &s, &n)
	lost = append(lost, goCall(p.Via(c, 5*time.Second), "lost", &s, &n))
	time.Sleep(200 * time.Millisecond) // the short call's deadline passes in the queue
	close(c.hold)
	held.Wait()
	if err := answered(t, short).Err(); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the call whose deadline passed in the queue: %v, want context.DeadlineExceeded", err)
	}
	for i, ch := range lost {
		if err := answered(t, ch).Err(); !errors.Is(err, errLost) {
			t.Fatalf("call %d of the lost pipeline: %v, want its lost answer", i, err)
		}
	}
	ctx := context.Background()
	if v := c.Client.Get(ctx, "lost").Val(); v != "2" {
		t.Fatalf("redis ran the lost calls %s times, want 2 (once each, none resent)", v)
	}
	if ex := c.Client.Exists(ctx, "short").Val(); ex != 0 {
		t.Fatal("the expired call was sent")
	}
	idle(t, p)
	doneOnce(t, &n, 3)
}

// TestScriptGoLoadsUnknownScript: a call nobody waits for whose script
// Redis does not know (NOSCRIPT: it did not run) is sent again as EVAL,
// the same way, and done runs once, with EVAL's answer.
func TestScriptGoLoadsUnknownScript(t *testing.T) {
	t.Parallel()
	c, _ := newPipeClient(t)
	ctx := context.Background()
	if err := c.Client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	var p Pipe
	var s spawner
	var n atomic.Int32
	if v, err := answered(t, goCall(p.Via(c, 5*time.Second), "flushed", &s, &n)).Int64(); err != nil || v != 1 {
		t.Fatalf("answer %d, %v; want 1 (run once, by EVAL)", v, err)
	}
	if c.lone.Load() != 2 || s.n.Load() != 2 {
		t.Fatalf("%d calls sent, %d goroutines started; want 2 and 2 (EVALSHA, then EVAL, each sent the same way)", c.lone.Load(), s.n.Load())
	}
	idle(t, &p)
	doneOnce(t, &n, 1)
}

// TestPipeGoHookPanics: a hook of the client that panics while a goroutine
// of the pipe sends a call nobody waits for fails the call with the panic
// (done runs), the pipe goes idle, and the panic goes on to spawn's
// recovery, which reports it; the same on a Cluster client, whose calls go
// alone.
func TestPipeGoHookPanics(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		via  func(p *Pipe, c *pipeClient) Sender
	}{
		{"pipe", func(p *Pipe, c *pipeClient) Sender { return p.Via(c, 5*time.Second) }},
		{"alone (cluster)", func(_ *Pipe, c *pipeClient) Sender { return timed{c, 5 * time.Second} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, _ := newPipeClient(t)
			var p Pipe
			var s spawner
			var n atomic.Int32
			c.panicNext.Store(true)
			err := answered(t, goCall(tc.via(&p, c), "panics", &s, &n)).Err()
			if err == nil || !strings.Contains(err.Error(), "panic") {
				t.Fatalf("the call whose hook panicked: %v, want the panic as its error", err)
			}
			if !waitUntil(func() bool { return len(s.recovered()) == 1 }) {
				t.Fatalf("spawn recovered %v, want the hook's panic", s.recovered())
			}
			if got := fmt.Sprint(s.recovered()[0]); got != "a hook panicked" {
				t.Fatalf("spawn recovered %q", got)
			}
			idle(t, &p)
			doneOnce(t, &n, 1)
			// The next call goes through.
			if v, err := answered(t, goCall(tc.via(&p, c), "after", &s, &n)).Int64(); err != nil || v != 1 {
				t.Fatalf("the next call: %d, %v", v, err)
			}
		})
	}
}

package redisconn

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// spawner counts the goroutines a pipe starts for calls nobody waits for.
type spawner struct{ n atomic.Int32 }

func (s *spawner) spawn(f func()) {
	s.n.Add(1)
	go f()
}

// goCall sends countScript on key through p without waiting; the answer
// (or error) arrives on the returned channel.
func goCall(p Sender, key string, s *spawner) <-chan *redis.Cmd {
	out := make(chan *redis.Cmd, 1)
	countScript.Go(p, []string{key}, nil, s.spawn, func(cmd *redis.Cmd) { out <- cmd })
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

// TestPipeGoAloneLeavesAtOnce: on an idle pipe, a call nobody waits for
// leaves at once, as a plain call, on a goroutine the pipe starts (not its
// caller's), and done gets its answer.
func TestPipeGoAloneLeavesAtOnce(t *testing.T) {
	t.Parallel()
	c, _ := newPipeClient(t)
	var p Pipe
	var s spawner
	ch := goCall(p.Via(c, 5*time.Second), "alone", &s)
	if v, err := answered(t, ch).Int64(); err != nil || v != 1 {
		t.Fatalf("answer %d, %v; want 1", v, err)
	}
	if s.n.Load() != 1 || c.lone.Load() != 1 {
		t.Fatalf("%d goroutines started, %d lone calls; want 1 and 1", s.n.Load(), c.lone.Load())
	}
	if !waitUntil(func() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.inflight == 0 }) {
		t.Fatal("the pipeline in flight was never ended")
	}
}

// TestPipeGoRidesWithWaitingCalls: calls nobody waits for that arrive
// while PipeInFlight pipelines are on their way start no goroutine: they
// leave in the next pipeline with the calls that wait, and their done runs
// on one goroutine started for all of them, after the waiting calls are
// answered.
func TestPipeGoRidesWithWaitingCalls(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	var s spawner
	const n = 6
	chs := make([]<-chan *redis.Cmd, n)
	for i := range chs {
		chs[i] = goCall(p.Via(c, 5*time.Second), "ride", &s)
	}
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = countScript.Run(context.Background(), p.Via(c, 5*time.Second), []string{"ride"}).Err()
		}()
	}
	if !waitUntil(func() bool { return p.Queued() == n+len(errs) }) {
		t.Fatalf("%d calls queued, want %d", p.Queued(), n+len(errs))
	}
	if s.n.Load() != 0 {
		t.Fatalf("%d goroutines started for queued calls, want 0", s.n.Load())
	}
	close(c.hold)
	held.Wait()
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("waiting call %d: %v", i, err)
		}
	}
	seen := map[int64]bool{}
	for _, ch := range chs {
		v, err := answered(t, ch).Int64()
		if err != nil || seen[v] {
			t.Fatalf("answer %d, %v (each call its own count)", v, err)
		}
		seen[v] = true
	}
	if v := c.Client.Get(context.Background(), "ride").Val(); v != "9" {
		t.Fatalf("redis ran the calls %s times, want 9", v)
	}
	if got := s.n.Load(); got > 2 {
		t.Fatalf("%d goroutines started, want at most 2 (one pipeline's done, at most one more pipeline)", got)
	}
}

// TestPipeGoQueuedAloneIsSent: calls nobody waits for, queued behind the
// pipelines on their way with no waiting caller to send them, leave once a
// pipeline is answered (a goroutine the pipe starts leads them).
func TestPipeGoQueuedAloneIsSent(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	var s spawner
	const n = 5
	chs := make([]<-chan *redis.Cmd, n)
	for i := range chs {
		chs[i] = goCall(p.Via(c, 5*time.Second), "queued", &s)
	}
	if p.Queued() != n {
		t.Fatalf("%d calls queued, want %d", p.Queued(), n)
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
	if p.Queued() != 0 {
		t.Fatalf("%d calls left in the queue", p.Queued())
	}
}

// TestPipeGoLostAndExpired: a call nobody waits for gets its pipeline's
// lost answer (never resent), and one whose deadline passed in the queue
// gets context.DeadlineExceeded, unsent.
func TestPipeGoLostAndExpired(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	c.loseAll.Store(true)
	var s spawner
	// The short call stands second: the first leads, and leaves it out.
	lost := []<-chan *redis.Cmd{goCall(p.Via(c, 5*time.Second), "lost", &s)}
	short := goCall(p.Via(c, 100*time.Millisecond), "short", &s)
	lost = append(lost, goCall(p.Via(c, 5*time.Second), "lost", &s))
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
}

// TestScriptGoLoadsUnknownScript: a call nobody waits for whose script
// Redis does not know (NOSCRIPT: it did not run) is sent again as EVAL.
func TestScriptGoLoadsUnknownScript(t *testing.T) {
	t.Parallel()
	c, _ := newPipeClient(t)
	ctx := context.Background()
	if err := c.Client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	var p Pipe
	var s spawner
	if v, err := answered(t, goCall(p.Via(c, 5*time.Second), "flushed", &s)).Int64(); err != nil || v != 1 {
		t.Fatalf("answer %d, %v; want 1 (run once, by EVAL)", v, err)
	}
}

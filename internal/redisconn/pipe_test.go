package redisconn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// countScript counts its calls on KEYS[1] and answers the count.
var countScript = NewScript("return redis.call('INCR', KEYS[1])")

// pipeClient wraps a real client: it counts lone calls and pipelines (and
// their sizes), can hold lone calls back until released, and can lose
// every answer after Redis ran the call (a lone call's or a pipeline's:
// which of the two the queued calls of a test leave in depends on which
// caller takes them first).
type pipeClient struct {
	*redis.Client
	hold    chan struct{} // lone calls each wait for a value, or its close (nil: none)
	held    atomic.Int32  // lone calls waiting on hold
	lone    atomic.Int32
	loseAll atomic.Bool
	// panicNext: the next lone call or pipeline panics (a hook that panics)
	panicNext atomic.Bool
	mu        sync.Mutex
	sizes     []int
}

func (c *pipeClient) Process(ctx context.Context, cmd redis.Cmder) error {
	c.lone.Add(1)
	if c.panicNext.CompareAndSwap(true, false) {
		panic("a hook panicked")
	}
	if c.hold != nil {
		c.held.Add(1)
		<-c.hold
	}
	err := c.Client.Process(ctx, cmd)
	if c.loseAll.Load() {
		// Redis ran it; the answer is lost on the way back.
		cmd.SetErr(errLost)
		return errLost
	}
	return err
}

func (c *pipeClient) Pipeline() redis.Pipeliner {
	return &countedPipeline{Pipeliner: c.Client.Pipeline(), c: c}
}

type countedPipeline struct {
	redis.Pipeliner
	c *pipeClient
	n int
}

func (p *countedPipeline) Process(ctx context.Context, cmd redis.Cmder) error {
	p.n++
	return p.Pipeliner.Process(ctx, cmd)
}

func (p *countedPipeline) Exec(ctx context.Context) ([]redis.Cmder, error) {
	if p.c.panicNext.CompareAndSwap(true, false) {
		panic("a hook panicked")
	}
	p.c.mu.Lock()
	p.c.sizes = append(p.c.sizes, p.n)
	p.c.mu.Unlock()
	cmds, err := p.Pipeliner.Exec(ctx)
	if p.c.loseAll.Load() {
		// Redis ran every command; the answers are lost on the way back.
		for _, cmd := range cmds {
			cmd.SetErr(errLost)
		}
		return cmds, errLost
	}
	return cmds, err
}

var errLost = errors.New("i/o timeout (answers lost after the write)")

func (c *pipeClient) batchSizes() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]int(nil), c.sizes...)
}

func newPipeClient(t *testing.T) (*pipeClient, *testredis.Server) {
	t.Helper()
	r := testredis.Start(t)
	rc := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
	t.Cleanup(func() { rc.Close() })
	if err := rc.ScriptLoad(context.Background(), countScript.Source()).Err(); err != nil {
		t.Fatal(err)
	}
	return &pipeClient{Client: rc}, r
}

// waitUntil polls cond for up to 10 s.
func waitUntil(cond func() bool) bool {
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// holdInFlight starts PipeInFlight calls on key that go out as plain calls
// and wait on c.hold, and waits until they do; wg ends with them.
func holdInFlight(t *testing.T, c *pipeClient, p *Pipe, key string, wg *sync.WaitGroup) {
	t.Helper()
	for i := 0; i < PipeInFlight; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = countScript.Run(context.Background(), p.Via(c, 5*time.Second), []string{key}).Err()
		}()
	}
	if !waitUntil(func() bool { return c.held.Load() == PipeInFlight }) {
		t.Fatalf("%d calls on their way, want %d", c.held.Load(), PipeInFlight)
	}
}

// heldPipe is a pipe over a new pipeClient whose PipeInFlight first calls,
// on key, are held on their way (holdInFlight); held ends with them once
// c.hold is closed.
func heldPipe(t *testing.T, key string) (c *pipeClient, p *Pipe, held *sync.WaitGroup) {
	t.Helper()
	c, _ = newPipeClient(t)
	p, held = new(Pipe), new(sync.WaitGroup)
	c.hold = make(chan struct{})
	holdInFlight(t, c, p, key, held)
	return c, p, held
}

// TestPipeSharesPipelines: the calls that wait while PipeInFlight calls
// are on their way leave together, as one pipeline, each answered with its
// own reply; a call alone goes as a plain call.
func TestPipeSharesPipelines(t *testing.T) {
	t.Parallel()
	c, _ := newPipeClient(t)
	var p Pipe
	ctx := context.Background()

	// Alone: a plain call, no pipeline.
	if n, err := countScript.Run(ctx, p.Via(c, 5*time.Second), []string{"alone"}).Int64(); err != nil || n != 1 {
		t.Fatalf("a lone call: %v, %v; want 1", n, err)
	}
	if c.lone.Load() != 1 || len(c.batchSizes()) != 0 {
		t.Fatalf("a lone call went as %d plain calls and pipelines %v; want 1 plain call", c.lone.Load(), c.batchSizes())
	}

	// Two calls held on their way, 30 more arrive meanwhile; one of the
	// two is answered first.
	c.lone.Store(0)
	c.hold = make(chan struct{})
	const n = 32
	got := make([]int64, n)
	errs := make([]error, n)
	var first, rest sync.WaitGroup
	start := func(wg *sync.WaitGroup, i int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = countScript.Run(ctx, p.Via(c, 5*time.Second), []string{"shared"}).Int64()
		}()
	}
	start(&first, 0)
	start(&first, 1)
	if !waitUntil(func() bool { return c.held.Load() == PipeInFlight }) {
		t.Fatalf("%d calls on their way, want %d", c.held.Load(), PipeInFlight)
	}
	for i := 2; i < n; i++ {
		start(&rest, i)
	}
	if !waitUntil(func() bool { return p.Queued() == n-PipeInFlight }) {
		t.Fatalf("%d calls queued, want %d", p.Queued(), n-PipeInFlight)
	}
	c.hold <- struct{}{}
	rest.Wait()
	if sizes := c.batchSizes(); len(sizes) != 1 || sizes[0] != n-PipeInFlight {
		t.Fatalf("pipelines %v; want one of %d (the calls that waited)", sizes, n-PipeInFlight)
	}
	close(c.hold)
	first.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	sort.Slice(got, func(i, j int) bool { return got[i] < got[j] })
	for i, v := range got {
		if v != int64(i+1) {
			t.Fatalf("answers %v: want 1..%d, each call its own answer", got, n)
		}
	}
	if c.lone.Load() != PipeInFlight {
		t.Fatalf("%d plain calls, want %d", c.lone.Load(), PipeInFlight)
	}
	if v := c.Client.Get(ctx, "shared").Val(); v != "32" {
		t.Fatalf("redis counted %s calls, want 32", v)
	}
}

// TestPipeLostBatch: when a pipeline's answers are lost after Redis ran
// it, every call in it fails (an outcome nobody knows), and nothing is
// sent again: Redis ran each call exactly once.
func TestPipeLostBatch(t *testing.T) {
	t.Parallel()
	c, p, wg := heldPipe(t, "lost")
	ctx := context.Background()
	c.loseAll.Store(true)
	const n = 10
	errs := make([]error, n)
	for i := PipeInFlight; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = countScript.Run(ctx, p.Via(c, 5*time.Second), []string{"lost"}).Err()
		}()
	}
	if !waitUntil(func() bool { return p.Queued() == n-PipeInFlight }) {
		t.Fatalf("%d calls queued, want %d", p.Queued(), n-PipeInFlight)
	}
	close(c.hold)
	wg.Wait()
	for i := PipeInFlight; i < n; i++ {
		if !errors.Is(errs[i], errLost) {
			t.Errorf("call %d of the lost pipeline: %v, want its lost answer", i, errs[i])
		}
	}
	if v := c.Client.Get(ctx, "lost").Val(); v != "10" {
		t.Fatalf("redis ran the calls %s times, want 10 (once each, none resent)", v)
	}
}

// TestPipeAbandonedCall: a caller whose context ends while its call waits
// in the queue gets its context's error once the next pipeline leaves, and
// the call is never sent.
func TestPipeAbandonedCall(t *testing.T) {
	t.Parallel()
	c, p, wg := heldPipe(t, "held")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- countScript.Run(ctx, p.Via(c, 5*time.Second), []string{"gave-up"}).Err() }()
	if !waitUntil(func() bool { return p.Queued() == 1 }) {
		t.Fatal("the call never queued")
	}
	cancel()
	close(c.hold)
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("abandoned call: %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the abandoned call did not return")
	}
	wg.Wait()
	if ex := c.Client.Exists(context.Background(), "gave-up").Val(); ex != 0 {
		t.Fatal("the abandoned call ran")
	}
	if p.Queued() != 0 {
		t.Fatalf("%d calls left in the queue", p.Queued())
	}
}

// TestPipeExpiredCallLeftOut: a call whose own deadline passes while it
// waits in the queue (behind pipelines Redis is slow to answer) is
// answered unsent, and does not cut the time of the calls that leave with
// it: they are answered.
func TestPipeExpiredCallLeftOut(t *testing.T) {
	t.Parallel()
	c, p, held := heldPipe(t, "held")
	short := make(chan error, 1)
	go func() {
		short <- countScript.Run(context.Background(), p.Via(c, 100*time.Millisecond), []string{"short"}).Err()
	}()
	if !waitUntil(func() bool { return p.Queued() == 1 }) {
		t.Fatal("the short call never queued")
	}
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = countScript.Run(context.Background(), p.Via(c, 5*time.Second), []string{"long"}).Err()
		}()
	}
	if !waitUntil(func() bool { return p.Queued() == 1+n }) {
		t.Fatalf("%d calls queued, want %d", p.Queued(), 1+n)
	}
	time.Sleep(200 * time.Millisecond) // the short call's deadline passes in the queue
	close(c.hold)
	held.Wait()
	wg.Wait()
	if err := <-short; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the call whose deadline passed in the queue: %v, want context.DeadlineExceeded", err)
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("call %d, queued with time left: %v", i, err)
		}
	}
	if ex := c.Client.Exists(context.Background(), "short").Val(); ex != 0 {
		t.Fatal("the expired call was sent")
	}
}

// TestPipeClusterCallsAlone: on a Cluster client every call goes alone
// (go-redis waits for every node of a pipeline, so one slow node would hold
// up the calls of all the others).
func TestPipeClusterCallsAlone(t *testing.T) {
	var p Pipe
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	defer cc.Close()
	if _, alone := p.Via(cc, time.Second).(timed); !alone {
		t.Fatalf("a Cluster client's calls go through %T, want each call alone", p.Via(cc, time.Second))
	}
	plain := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer plain.Close()
	if _, piped := p.Via(plain, time.Second).(piped); !piped {
		t.Fatal("a plain client's calls do not go through the pipe")
	}
}

// A piped call ends by its bound even when it must first wait for the
// pool's only connection and then for a dial that never completes (a SYN
// lost after a failover): the context go-redis gets must end at the
// deadline, not only report it (the pool's wait and the wait for a new
// connection watch Done, bounded by PoolTimeout and DialTimeout, here far
// longer than the call's bound).
func TestPipeCallEndsByItsBound(t *testing.T) {
	r := testredis.Start(t)
	const bound = 300 * time.Millisecond
	var dials atomic.Int32
	c := redis.NewClient(&redis.Options{Addr: r.Addr, PoolSize: 1, PoolTimeout: 3 * time.Second, DialTimeout: 3 * time.Second,
		ReadTimeout: 3 * time.Second, WriteTimeout: 3 * time.Second, MaxRetries: -1, DialerRetries: 1, ContextTimeoutEnabled: true, Protocol: 2,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if dials.Add(1) == 1 {
				return (&net.Dialer{}).DialContext(ctx, network, addr)
			}
			<-ctx.Done() // blackholed
			return nil, ctx.Err()
		}})
	defer c.Close()
	held := make(chan struct{})
	go func() {
		// Holds the only connection until just before the call's bound
		// ends, then loses it to a timeout: the call needs a new one.
		ctx, cancel := context.WithTimeout(context.Background(), bound-50*time.Millisecond)
		defer cancel()
		close(held)
		c.BLPop(ctx, 10*time.Second, "pipe:nokey")
	}()
	<-held
	time.Sleep(20 * time.Millisecond)
	var p Pipe
	cmd := NoRetry{redis.NewCmd(context.Background(), "ping")}
	start := time.Now()
	err := p.Via(c, bound).Process(context.Background(), cmd)
	took := time.Since(start)
	if err == nil {
		t.Fatal("the call succeeded without a connection")
	}
	if took > bound+time.Second {
		t.Fatalf("the call took %v (%v), its bound is %v", took.Round(time.Millisecond), err, bound)
	}
}

// TestPipeReusedCallsAnswerTheirOwn: calls of many callers, reused from
// call to call, each get their own answer, over many rounds of queued
// pipelines: a wake-up left in a reused call would answer the next one
// before Redis did.
func TestPipeReusedCallsAnswerTheirOwn(t *testing.T) {
	t.Parallel()
	c, _ := newPipeClient(t)
	var p Pipe
	ctx := context.Background()
	const callers, calls = 32, 200
	var wg sync.WaitGroup
	var wrong atomic.Int64
	var firstErr atomic.Value
	for g := 0; g < callers; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < calls; i++ {
				want := fmt.Sprintf("c%d-%d", g, i)
				cmd := redis.NewStringCmd(ctx, "echo", want)
				if err := p.Via(c, 5*time.Second).Process(ctx, cmd); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				if cmd.Val() != want {
					wrong.Add(1)
				}
			}
		}(g)
	}
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		t.Fatal(err)
	}
	if n := wrong.Load(); n != 0 {
		t.Fatalf("%d calls got an answer not their own", n)
	}
	if len(c.batchSizes()) == 0 {
		t.Fatal("no call waited in the queue: the test did not reach the queued path")
	}
}

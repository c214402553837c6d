package redisdlm

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Batching of rate-limit decisions: the requests of one Redis client hand
// their script call to a worker, which sends whatever is waiting as one
// pipeline (its decisions as one script call, see ratelimit_multi.go). An
// idle worker sends at once; while a pipeline is in flight, new calls
// accumulate and leave together.

const (
	// Pipelines in flight at once, per Redis client. One: under load each
	// then carries all that arrived during the last round trip (one write,
	// one read and one script call for all of them, on Caddy's side and on
	// Redis's; with 2, each carried half as many for the same latency), and
	// an idle worker still sends at once.
	batchWorkers = 1
	batchMax     = 128 // script calls per pipeline
	batchQueue   = 1024

	breakerThreshold = 3           // consecutive failures that open the breaker
	breakerProbe     = time.Second // how often an open breaker lets one call try Redis
)

var (
	errRedisTimeout = errors.New("redisdlm: redis did not answer within the timeout")
	errBreakerOpen  = errors.New("redisdlm: redis unreachable (circuit breaker open)")
	errBatcherDone  = errors.New("redisdlm: redis client closed")
)

// rlBatcher sends the script calls of one Redis client in pipelines, and
// keeps the breaker of that client.
type rlBatcher struct {
	client  redis.UniversalClient
	cluster bool // group batches per hash slot
	queue   chan *rlCall
	stop    chan struct{}
	once    sync.Once
	breaker breaker
}

// rlCall is one request's script call.
type rlCall struct {
	script   *luaScript
	keys     []string
	argv     []any        // a decision: its parameter set (shared by the calls of one plan)
	deadline time.Time    // answered by then: a worker does not send a call taken later
	state    atomic.Int32 // callPending, callTaken or callAbandoned
	res      []int64      // a decision's answer (see the decision scripts)
	err      error
	done     chan struct{} // closed by the worker that took the call
	finished bool          // done is closed (the worker's own record)
}

const (
	callPending int32 = iota
	callTaken
	callAbandoned
)

func newBatcher(c redis.UniversalClient, workers int) *rlBatcher {
	_, cluster := c.(*redis.ClusterClient)
	b := &rlBatcher{
		client:  c,
		cluster: cluster,
		queue:   make(chan *rlCall, batchQueue),
		stop:    make(chan struct{}),
	}
	for i := 0; i < workers; i++ {
		go b.work()
	}
	return b
}

// close stops the workers (the last handler using this client is gone).
// Waiting callers get errBatcherDone.
func (b *rlBatcher) close() {
	b.once.Do(func() { close(b.stop) })
}

// do runs one call through the breaker and the pipeline: refused at once
// while the breaker is open; otherwise its outcome (a Redis failure or an
// answer) is what the breaker counts. logger gets the breaker's changes.
func (b *rlBatcher) do(ctx context.Context, c *rlCall, timeout time.Duration, logger *zap.Logger) ([]int64, error) {
	if !b.breaker.allow(time.Now()) {
		return nil, errBreakerOpen
	}
	res, err := b.call(ctx, c, timeout)
	switch {
	case err == nil:
		b.breaker.success(logger)
	case ctx.Err() != nil:
		// The client went away: says nothing about Redis.
	case errors.Is(err, errRedisTimeout) || isRedisDown(err) || isAuthFailure(err):
		b.breaker.failure(time.Now(), logger)
	}
	return res, err
}

// isAuthFailure reports whether Redis refused this client's credentials or
// permissions: every call fails the same way until the config changes, so
// the breaker counts it like an unreachable Redis (and spares Redis a
// failing AUTH per request).
func isAuthFailure(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	for _, p := range []string{"WRONGPASS", "NOAUTH", "NOPERM", "ERR AUTH", "ERR invalid password", "ERR Client sent AUTH"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// call runs one script call through the pipeline and waits at most
// timeout (or until ctx ends) for its answer. A call given up before a
// worker took it never runs.
//
// No timer per call: the worker that takes a call answers it by its
// deadline (a call taken too late is not sent; a pipeline's context ends at
// the earliest deadline in it). Only a full queue waits with a timer.
func (b *rlBatcher) call(ctx context.Context, c *rlCall, timeout time.Duration) ([]int64, error) {
	c.deadline = time.Now().Add(timeout)
	c.done = make(chan struct{})
	select {
	case b.queue <- c:
	default:
		if err := b.enqueueSlow(ctx, c, timeout); err != nil {
			return nil, err
		}
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		// If a worker took it already, it ends by the call's deadline.
		c.state.CompareAndSwap(callPending, callAbandoned)
		return nil, ctx.Err()
	case <-b.stop:
		if c.state.CompareAndSwap(callPending, callAbandoned) {
			return nil, errBatcherDone
		}
		// Taken: the worker answers it by the deadline.
		select {
		case <-c.done:
			return c.res, c.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// enqueueSlow waits for room in a full queue, at most timeout.
func (b *rlBatcher) enqueueSlow(ctx context.Context, c *rlCall, timeout time.Duration) error {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case b.queue <- c:
		return nil
	case <-b.stop:
		return errBatcherDone
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return errRedisTimeout
	}
}

// work is one worker: it takes a call, adds whatever else waits, and sends
// them as one pipeline.
func (b *rlBatcher) work() {
	batch := make([]*rlCall, 0, batchMax)
	for {
		batch = batch[:0]
		select {
		case <-b.stop:
			return
		case c := <-b.queue:
			batch = b.take(batch, c)
		}
		batch = b.fill(batch)
		if len(batch) < batchMax {
			// Let the requests that are running right now reach their
			// decision first (auto-pipelining): under load they join this
			// pipeline instead of the next; with nothing else to run this
			// returns at once.
			runtime.Gosched()
			batch = b.fill(batch)
		}
		if len(batch) > 0 {
			b.send(batch)
		}
	}
}

// fill adds to batch whatever waits in the queue, up to batchMax.
func (b *rlBatcher) fill(batch []*rlCall) []*rlCall {
	for len(batch) < batchMax {
		select {
		case c := <-b.queue:
			batch = b.take(batch, c)
		default:
			return batch
		}
	}
	return batch
}

// take adds c to batch unless its caller gave up, or its deadline passed
// while it waited in the queue (then it is answered at once, unsent).
func (b *rlBatcher) take(batch []*rlCall, c *rlCall) []*rlCall {
	if !c.state.CompareAndSwap(callPending, callTaken) {
		return batch
	}
	if !time.Now().Before(c.deadline) {
		c.finish(errRedisTimeout)
		return batch
	}
	return append(batch, c)
}

// send runs one pipeline; every call in batch is answered, also on panic.
func (b *rlBatcher) send(batch []*rlCall) {
	defer func() {
		if r := recover(); r != nil {
			caddy.Log().Named("redisdlm").Error("panic in the redis_ratelimit batcher; recovered", zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
			for _, c := range batch {
				c.finish(fmt.Errorf("redisdlm: panic in batcher: %v", r))
			}
		}
	}()
	b.sendUnits(units(batch, b.cluster))
}

// sendUnits sends the units as one pipeline, within the earliest deadline of
// their calls, and answers every call.
func (b *rlBatcher) sendUnits(us []*rlUnit) {
	deadline := us[0].calls[0].deadline
	for _, u := range us {
		for _, c := range u.calls {
			if c.deadline.Before(deadline) {
				deadline = c.deadline
			}
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()

	cmds, execErr := b.exec(ctx, us, false)
	// After a Redis restart or SCRIPT FLUSH a script is unknown: send those
	// units again with EVAL (which also caches the script). NOSCRIPT means
	// the script did not run, so nothing is counted twice.
	var retry []*rlUnit
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			retry = append(retry, us[i])
		}
	}
	if len(retry) > 0 {
		again, err := b.exec(ctx, retry, true)
		for i, j := 0, 0; i < len(us) && j < len(retry); i++ {
			if us[i] == retry[j] {
				cmds[i] = again[j]
				j++
			}
		}
		execErr = err
	}
	var alone []*rlUnit // decisions of a batch that failed before writing
	for i, u := range us {
		err := cmds[i].Err()
		if err != nil && ctx.Err() != nil && isRedisDown(err) {
			// The deadline of the first call in the pipeline passed.
			err = fmt.Errorf("%w (%v)", errRedisTimeout, err)
		}
		if err == nil && execErr != nil && unanswered(cmds[i]) {
			// The pipeline failed before this call got an answer (e.g. the
			// connection's AUTH was refused): that failure is its answer.
			err = execErr
		}
		if err == nil && u.batch && !u.answer(cmds[i].(noRetryInts).Val()) {
			err = answerError(fmt.Sprintf("redis_ratelimit: unexpected answer to a batch of %d decisions", len(u.calls)))
		}
		for _, c := range u.calls {
			switch {
			case err != nil || !u.batch:
				c.finish(err)
			case len(u.calls) > 1 && c.res[0] == failedRead:
				// Nothing of it was written: alone, it fails with Redis's
				// own error (or, if its key changed meanwhile, is decided).
				c.res = nil
				alone = append(alone, &rlUnit{calls: []*rlCall{c}, batch: true})
			case c.res[0] == failedRun:
				c.res = nil
				c.finish(errFailedRun)
			default:
				c.finish(nil)
			}
		}
	}
	if len(alone) > 0 {
		b.sendUnits(alone)
	}
}

// errFailedRun answers a decision of a batch that failed once it had begun
// recording (Redis refused a write, e.g. out of memory): it is not sent
// again, so nothing is counted twice.
var errFailedRun = answerError("redis_ratelimit: the decision failed while recording it (Redis refused a write, e.g. out of memory); not sent again")

// answerError is an answer from Redis that makes no sense as a decision: a
// fault, but not one of reaching Redis (the breaker does not count it).
type answerError string

func (e answerError) Error() string { return string(e) }

// RedisError marks it as an answer from Redis (see isRedisDown).
func (e answerError) RedisError() {}

// finish answers c (once).
func (c *rlCall) finish(err error) {
	if c.finished {
		return
	}
	c.finished = true
	c.err = err
	close(c.done)
}

// unanswered reports whether cmd got no answer at all.
func unanswered(cmd redis.Cmder) bool {
	switch c := cmd.(type) {
	case noRetryInts:
		return c.Val() == nil
	case noRetry:
		return c.Val() == nil
	}
	return false
}

// exec sends the units as one pipeline (with EVAL when eval); a decision
// batch is read as a flat array of integers. No command is ever sent again
// after a transport error (a Cluster client otherwise resends a pipeline
// whose answers were lost, which would count its decisions twice, or return
// an admission twice); a MOVED or ASK answer, which means the command did
// not run, is still followed.
func (b *rlBatcher) exec(ctx context.Context, us []*rlUnit, eval bool) ([]redis.Cmder, error) {
	cmds := make([]redis.Cmder, len(us))
	pipe := b.client.Pipeline()
	for i, u := range us {
		cmds[i] = u.cmd(ctx, eval)
		_ = pipe.Process(ctx, cmds[i])
	}
	_, err := pipe.Exec(ctx)
	return cmds, err
}

// cmd is the unit's command, never resent by go-redis.
func (u *rlUnit) cmd(ctx context.Context, eval bool) redis.Cmder {
	if u.batch {
		return noRetryInts{redis.NewIntSliceCmd(ctx, u.command(eval)...)}
	}
	return noRetry{redis.NewCmd(ctx, u.command(eval)...)}
}

// breaker stops calling a Redis that failed breakerThreshold times in a row;
// then it lets one call through about once per breakerProbe, and closes
// again at the first success.
type breaker struct {
	fails     atomic.Int32
	open      atomic.Bool
	mu        sync.Mutex
	nextProbe time.Time
}

// allow reports whether a call may go to Redis now.
func (b *breaker) allow(now time.Time) bool {
	if !b.open.Load() {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Before(b.nextProbe) {
		return false
	}
	b.nextProbe = now.Add(breakerProbe)
	return true
}

func (b *breaker) success(logger *zap.Logger) {
	if b.fails.Load() != 0 || b.open.Load() {
		b.fails.Store(0)
		if b.open.Swap(false) {
			logger.Info("redis reachable again; rate limiting resumes")
		}
	}
}

func (b *breaker) failure(now time.Time, logger *zap.Logger) {
	if b.fails.Add(1) >= breakerThreshold && !b.open.Load() {
		b.mu.Lock()
		b.nextProbe = now.Add(breakerProbe)
		opened := !b.open.Swap(true)
		b.mu.Unlock()
		if opened {
			logger.Warn("redis unreachable: rate-limit decisions follow the fail policy without calling redis; probing it every second",
				zap.Int("consecutive_failures", breakerThreshold))
		}
	}
}

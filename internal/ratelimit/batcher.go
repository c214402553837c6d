package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

// Batching of rate-limit decisions: the requests of one Redis client hand
// their script call to a worker, which sends whatever is waiting as one
// pipeline (its decisions as one script call, see multi.go). An
// idle worker sends at once; while a pipeline is in flight, new calls
// accumulate and leave together.

const (
	batchMax     = 128 // script calls per pipeline
	batchQueue   = 1024
	breakerProbe = time.Second // how often an open breaker lets one call try Redis
)

// Batcher sends the script calls of one Redis client in pipelines, and
// keeps the breaker of that client.
type Batcher struct {
	client  Client
	clock   Clock
	logger  func() *slog.Logger // for a panic of a worker
	cluster bool                // group batches per hash slot
	queue   chan *Call
	stop    chan struct{}
	once    sync.Once
	breaker breaker
}

// Call is one script call of a limit (Limit.DecisionCall, ReturnCall), run
// by Batcher.Do; a decision's answer is read with Decision.
type Call struct {
	script   *redisconn.Script
	keys     []string     // a decision: one per rate
	banKey   string       // a decision whose parameter set bans: the key's ban
	indexKey string       // a decision whose rates are rendered per request: the key's rate index
	argv     []any        // a decision: its parameter set (shared by the calls of one plan)
	lean     bool         // a decision whose admission is never returned: its answer has 2 integers per rate (perRate)
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

// newBatcher starts a batcher (NewBatcher).
func newBatcher(c Client, o Options) *Batcher {
	_, cluster := c.(*redis.ClusterClient)
	b := &Batcher{
		client:  c,
		clock:   o.Clock,
		logger:  o.Logger,
		cluster: cluster,
		queue:   make(chan *Call, batchQueue),
		stop:    make(chan struct{}),
	}
	if b.clock == nil {
		b.clock = SystemClock{}
	}
	if b.logger == nil {
		b.logger = slog.Default
	}
	for i := 0; i < o.Workers; i++ {
		go b.work()
	}
	return b
}

// close stops the workers (Batcher.Close).
func (b *Batcher) close() {
	b.once.Do(func() { close(b.stop) })
}

// do runs one call through the breaker and the pipeline (Batcher.Do).
func (b *Batcher) do(ctx context.Context, c *Call, timeout time.Duration, obs Observer) error {
	if !b.breaker.allow(b.clock.Now()) {
		return ErrBreakerOpen
	}
	err := b.call(ctx, c, timeout)
	switch {
	case err == nil:
		b.breaker.success(obs)
	case ctx.Err() != nil:
		// The client went away: says nothing about Redis.
	case errors.Is(err, ErrRedisTimeout) || redisconn.IsRedisDown(err) || isAuthFailure(err):
		b.breaker.failure(b.clock.Now(), obs)
	}
	return err
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
func (b *Batcher) call(ctx context.Context, c *Call, timeout time.Duration) error {
	c.deadline = time.Now().Add(timeout)
	c.done = make(chan struct{})
	select {
	case b.queue <- c:
	default:
		if err := b.enqueueSlow(ctx, c, timeout); err != nil {
			return err
		}
	}
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		// If a worker took it already, it ends by the call's deadline.
		c.state.CompareAndSwap(callPending, callAbandoned)
		return ctx.Err()
	case <-b.stop:
		if c.state.CompareAndSwap(callPending, callAbandoned) {
			return ErrBatcherDone
		}
		// Taken: the worker answers it by the deadline.
		select {
		case <-c.done:
			return c.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// enqueueSlow waits for room in a full queue, at most timeout.
func (b *Batcher) enqueueSlow(ctx context.Context, c *Call, timeout time.Duration) error {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case b.queue <- c:
		return nil
	case <-b.stop:
		return ErrBatcherDone
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return ErrRedisTimeout
	}
}

// work is one worker: it takes a call, adds whatever else waits, and sends
// them as one pipeline.
func (b *Batcher) work() {
	batch := make([]*Call, 0, batchMax)
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
func (b *Batcher) fill(batch []*Call) []*Call {
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
func (b *Batcher) take(batch []*Call, c *Call) []*Call {
	if !c.state.CompareAndSwap(callPending, callTaken) {
		return batch
	}
	if !time.Now().Before(c.deadline) {
		c.finish(ErrRedisTimeout)
		return batch
	}
	return append(batch, c)
}

// send runs one pipeline; every call in batch is answered, also on panic.
func (b *Batcher) send(batch []*Call) {
	defer func() {
		if r := recover(); r != nil {
			b.logger().Error("panic in the redis_ratelimit batcher; recovered", slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
			for _, c := range batch {
				c.finish(fmt.Errorf("redisdlm: panic in batcher: %v", r))
			}
		}
	}()
	b.sendUnits(units(batch, b.cluster))
}

// sendUnits sends the units as one pipeline, within the earliest deadline of
// their calls, and answers every call.
func (b *Batcher) sendUnits(us []*rlUnit) {
	ctx, cancel := context.WithDeadline(context.Background(), earliestDeadline(us))
	defer cancel()
	cmds, execErr := b.exec(ctx, us, bySHA)
	cmds, execErr = b.resendUnknownScripts(ctx, us, cmds, execErr)
	var alone []*rlUnit // decisions of a batch that failed before writing
	for i, u := range us {
		alone = u.answerCalls(unitError(ctx, u, cmds[i], execErr), alone)
	}
	if len(alone) > 0 {
		b.sendUnits(alone)
	}
}

// earliestDeadline is the earliest deadline of the units' calls.
func earliestDeadline(us []*rlUnit) time.Time {
	deadline := us[0].calls[0].deadline
	for _, u := range us {
		for _, c := range u.calls {
			if c.deadline.Before(deadline) {
				deadline = c.deadline
			}
		}
	}
	return deadline
}

// resendUnknownScripts sends again, with EVAL (which also caches the
// script), the units whose script Redis did not know (after a restart or
// SCRIPT FLUSH), and puts their answers in cmds. NOSCRIPT means the script
// did not run, so nothing is counted twice.
func (b *Batcher) resendUnknownScripts(ctx context.Context, us []*rlUnit, cmds []redis.Cmder, execErr error) ([]redis.Cmder, error) {
	var retry []*rlUnit
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			retry = append(retry, us[i])
		}
	}
	if len(retry) == 0 {
		return cmds, execErr
	}
	again, err := b.exec(ctx, retry, byText)
	for i, j := 0, 0; i < len(us) && j < len(retry); i++ {
		if us[i] == retry[j] {
			cmds[i] = again[j]
			j++
		}
	}
	return cmds, err
}

// unitError is the failure of a unit's command (nil when it was answered),
// and splits a batch's answer among its calls.
func unitError(ctx context.Context, u *rlUnit, cmd redis.Cmder, execErr error) error {
	err := cmd.Err()
	if err != nil && ctx.Err() != nil && redisconn.IsRedisDown(err) {
		// The deadline of the first call in the pipeline passed.
		err = fmt.Errorf("%w (%v)", ErrRedisTimeout, err)
	}
	if err == nil && execErr != nil && unanswered(cmd) {
		// The pipeline failed before this call got an answer (e.g. the
		// connection's AUTH was refused): that failure is its answer.
		err = execErr
	}
	if err == nil && u.batch && !u.answer(cmd.(redisconn.NoRetryInts).Val()) {
		err = answerError(fmt.Sprintf("redis_ratelimit: unexpected answer to a batch of %d decisions", len(u.calls)))
	}
	return err
}

// answerCalls answers the unit's calls (err: the unit failed), and returns
// alone with the decisions of a batch that failed before writing added:
// they are sent again, each alone.
func (u *rlUnit) answerCalls(err error, alone []*rlUnit) []*rlUnit {
	for _, c := range u.calls {
		switch {
		case err != nil || !u.batch:
			c.finish(err)
		case len(u.calls) > 1 && c.res[0] == failedRead:
			// Nothing of it was written: alone, it fails with Redis's
			// own error (or, if its key changed meanwhile, is decided).
			c.res = nil
			alone = append(alone, &rlUnit{calls: []*Call{c}, batch: true})
		case c.res[0] == failedRun:
			c.res = nil
			c.finish(ErrFailedRun)
		default:
			c.finish(nil)
		}
	}
	return alone
}

// answerError is an answer from Redis that makes no sense as a decision: a
// fault, but not one of reaching Redis (the breaker does not count it).
type answerError string

func (e answerError) Error() string { return string(e) }

// RedisError marks it as an answer from Redis (see isRedisDown).
func (e answerError) RedisError() {}

// finish answers c (once).
func (c *Call) finish(err error) {
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
	case redisconn.NoRetryInts:
		return c.Val() == nil
	case redisconn.NoRetry:
		return c.Val() == nil
	}
	return false
}

// sendAs is how a command names its script: by SHA1 (EVALSHA) or by its
// text (EVAL).
type sendAs int

const (
	bySHA sendAs = iota
	byText
)

// exec sends the units as one pipeline (naming their scripts as), a decision
// batch is read as a flat array of integers. No command is ever sent again
// after a transport error (a Cluster client otherwise resends a pipeline
// whose answers were lost, which would count its decisions twice, or return
// an admission twice); a MOVED or ASK answer, which means the command did
// not run, is still followed.
func (b *Batcher) exec(ctx context.Context, us []*rlUnit, as sendAs) ([]redis.Cmder, error) {
	cmds := make([]redis.Cmder, len(us))
	pipe := b.client.Pipeline()
	for i, u := range us {
		cmds[i] = u.cmd(ctx, as)
		_ = pipe.Process(ctx, cmds[i])
	}
	_, err := pipe.Exec(ctx)
	return cmds, err
}

// cmd is the unit's command, never resent by go-redis.
func (u *rlUnit) cmd(ctx context.Context, as sendAs) redis.Cmder {
	if u.batch {
		return redisconn.NoRetryInts{IntSliceCmd: redis.NewIntSliceCmd(ctx, u.command(as)...)}
	}
	return redisconn.NoRetry{Cmd: redis.NewCmd(ctx, u.command(as)...)}
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

func (b *breaker) success(obs Observer) {
	if b.fails.Load() != 0 || b.open.Load() {
		b.fails.Store(0)
		if b.open.Swap(false) && obs != nil {
			obs.BreakerClosed()
		}
	}
}

func (b *breaker) failure(now time.Time, obs Observer) {
	if b.fails.Add(1) >= BreakerThreshold && !b.open.Load() {
		b.mu.Lock()
		b.nextProbe = now.Add(breakerProbe)
		opened := !b.open.Swap(true)
		b.mu.Unlock()
		if opened && obs != nil {
			obs.BreakerOpened(BreakerThreshold)
		}
	}
}

// sendNow sends calls as one pipeline at once (Batcher.SendNow).
func (b *Batcher) sendNow(calls []*Call) {
	for _, c := range calls {
		c.deadline = time.Now().Add(5 * time.Second)
		c.done = make(chan struct{})
		c.finished = false
		c.state.Store(callTaken)
	}
	b.send(calls)
}

package redisdlm

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Batching of rate-limit decisions: the requests of one Redis client hand
// their script call to a few workers, which send whatever is waiting as one
// pipeline. An idle worker sends at once; while pipelines are in flight,
// new calls accumulate and leave together. Every request is still exactly
// one script call.

const (
	batchWorkers = 4   // pipelines in flight at once, per Redis client
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

// rlBatchers holds one batcher per Redis client, keyed like clientPool.
var rlBatchers = caddy.NewUsagePool()

// rlBatcher sends the script calls of one Redis client in pipelines.
type rlBatcher struct {
	client  redis.UniversalClient
	timeout time.Duration // of one pipeline
	logger  *zap.Logger
	queue   chan *rlCall
	stop    chan struct{}
	once    sync.Once
	breaker breaker
}

// rlCall is one request's script call.
type rlCall struct {
	script *redis.Script
	keys   []string
	args   []any
	state  atomic.Int32 // callPending, callTaken or callAbandoned
	res    any
	err    error
	done   chan struct{} // closed by the worker that took the call
}

const (
	callPending int32 = iota
	callTaken
	callAbandoned
)

func acquireBatcher(pc *pooledClient, logger *zap.Logger) (*rlBatcher, string, error) {
	key := "ratelimit:" + pc.settings.poolKey()
	val, _, err := rlBatchers.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newBatcher(pc.client, pc.settings.Timeout, logger, batchWorkers), nil
	})
	if err != nil {
		return nil, "", err
	}
	return val.(*rlBatcher), key, nil
}

func releaseBatcher(key string) {
	if key != "" {
		_, _ = rlBatchers.Delete(key)
	}
}

func newBatcher(c redis.UniversalClient, timeout time.Duration, logger *zap.Logger, workers int) *rlBatcher {
	b := &rlBatcher{
		client:  c,
		timeout: timeout,
		logger:  logger,
		queue:   make(chan *rlCall, batchQueue),
		stop:    make(chan struct{}),
	}
	b.breaker.logger = logger
	for i := 0; i < workers; i++ {
		go b.work()
	}
	return b
}

// Destruct implements caddy.Destructor: the last handler using this client
// is gone, so the workers stop. Waiting callers get errBatcherDone.
func (b *rlBatcher) Destruct() error {
	b.once.Do(func() { close(b.stop) })
	return nil
}

// do runs one script call through the pipeline and waits at most timeout
// (or until ctx ends) for its answer. A call given up before a worker took
// it never runs.
func (b *rlBatcher) do(ctx context.Context, script *redis.Script, keys []string, args []any, timeout time.Duration) (any, error) {
	c := &rlCall{script: script, keys: keys, args: args, done: make(chan struct{})}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case b.queue <- c:
	case <-b.stop:
		return nil, errBatcherDone
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-timer.C:
		return nil, errRedisTimeout
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		// If a worker took it already, it ends within its own timeout.
		c.state.CompareAndSwap(callPending, callAbandoned)
		return nil, ctx.Err()
	case <-timer.C:
		c.state.CompareAndSwap(callPending, callAbandoned)
		return nil, errRedisTimeout
	case <-b.stop:
		if c.state.CompareAndSwap(callPending, callAbandoned) {
			return nil, errBatcherDone
		}
		select {
		case <-c.done:
			return c.res, c.err
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-timer.C:
			return nil, errRedisTimeout
		}
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
			if c.state.CompareAndSwap(callPending, callTaken) {
				batch = append(batch, c)
			}
		}
	fill:
		for len(batch) < batchMax {
			select {
			case c := <-b.queue:
				if c.state.CompareAndSwap(callPending, callTaken) {
					batch = append(batch, c)
				}
			default:
				break fill
			}
		}
		if len(batch) > 0 {
			b.send(batch)
		}
	}
}

// send runs one pipeline; every call in batch is answered, also on panic.
func (b *rlBatcher) send(batch []*rlCall) {
	answered := false
	defer func() {
		if r := recover(); r != nil {
			b.logger.Error("panic in redis_ratelimit batcher", zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
			if !answered {
				for _, c := range batch {
					c.err = fmt.Errorf("redisdlm: panic in batcher: %v", r)
					close(c.done)
				}
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()

	cmds := make([]*redis.Cmd, len(batch))
	pipe := b.client.Pipeline()
	for i, c := range batch {
		cmds[i] = c.script.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx)
	// After a Redis restart or SCRIPT FLUSH the script is unknown: send those
	// calls again with EVAL (which also caches the script). NOSCRIPT means the
	// script did not run, so nothing is counted twice.
	var retry []int
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			retry = append(retry, i)
		}
	}
	if len(retry) > 0 {
		pipe = b.client.Pipeline()
		for _, i := range retry {
			cmds[i] = batch[i].script.Eval(ctx, pipe, batch[i].keys, batch[i].args...)
		}
		_, _ = pipe.Exec(ctx)
	}
	answered = true
	for i, c := range batch {
		c.res, c.err = cmds[i].Result()
		close(c.done)
	}
}

// breaker stops calling a Redis that failed breakerThreshold times in a row;
// then it lets one call through about once per breakerProbe, and closes
// again at the first success.
type breaker struct {
	logger    *zap.Logger
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

func (b *breaker) success() {
	if b.fails.Load() != 0 || b.open.Load() {
		b.fails.Store(0)
		if b.open.Swap(false) {
			b.logger.Info("redis reachable again; rate limiting resumes")
		}
	}
}

func (b *breaker) failure(now time.Time) {
	if b.fails.Add(1) >= breakerThreshold && !b.open.Load() {
		b.mu.Lock()
		b.nextProbe = now.Add(breakerProbe)
		opened := !b.open.Swap(true)
		b.mu.Unlock()
		if opened {
			b.logger.Warn("redis unreachable: rate-limit decisions follow the fail policy without calling redis; probing it every second",
				zap.Int("consecutive_failures", breakerThreshold))
		}
	}
}

package redisconn

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// pipeMax bounds the commands in one pipeline; the rest wait for the next.
const pipeMax = 256

// pipeCall is one caller's command in the queue.
type pipeCall struct {
	ctx      context.Context
	deadline time.Time // the call's: its context's, or timeout from the call
	cmd      redis.Cmder
	state    atomic.Int32  // pipePending or pipeTaken
	lead     bool          // set before wake is signalled: the caller sends the queue
	wake     chan struct{} // buffered; signalled once, when the call is answered or must lead
	// A call nobody waits for (Pipe.Go): done runs once it is answered,
	// instead of a wake-up; when it must lead, spawn starts the goroutine
	// that sends it on c.
	done  func()
	spawn func(func())
	c     Pipeliner
}

const (
	pipePending int32 = iota
	pipeTaken
)

// timed sends each call alone, bounded by timeout.
type timed struct {
	c       Processor
	timeout time.Duration
}

func (t timed) Process(ctx context.Context, cmd redis.Cmder) error {
	ctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	return t.c.Process(ctx, cmd)
}

type piped struct {
	p       *Pipe
	c       Pipeliner
	timeout time.Duration
}

func (v piped) Process(ctx context.Context, cmd redis.Cmder) error {
	return v.p.process(ctx, v.c, v.timeout, cmd)
}

func (v piped) Go(cmd redis.Cmder, done func(), spawn func(func())) {
	v.p.send(v.c, v.timeout, cmd, done, spawn)
}

func (t timed) Go(cmd redis.Cmder, done func(), spawn func(func())) {
	spawn(func() {
		defer done() // also after a panic of a hook, which goes on to spawn's recovery
		defer func() {
			if r := recover(); r != nil {
				cmd.SetErr(fmt.Errorf("redisdlm: panic sending a call: %v", r))
				panic(r)
			}
		}()
		_ = t.Process(context.Background(), cmd)
	})
}

// send queues cmd for the next pipeline, or, when fewer than PipeInFlight
// are on their way, has spawn start one that carries it at once. Under
// load a call nobody waits for costs no goroutine of its own: a pipeline
// that leaves takes it, and its done runs with the others of that
// pipeline.
func (p *Pipe) send(c Pipeliner, timeout time.Duration, cmd redis.Cmder, done func(), spawn func(func())) {
	call := &pipeCall{ctx: context.Background(), cmd: cmd, deadline: time.Now().Add(timeout), done: done, spawn: spawn, c: c}
	p.mu.Lock()
	if p.inflight < PipeInFlight {
		p.inflight++
		p.mu.Unlock()
		call.state.Store(pipeTaken)
		p.spawnLead(call)
		return
	}
	p.queue = append(p.queue, call)
	p.mu.Unlock()
}

// process sends cmd with the commands of other callers and waits for its
// answer (cmd's own error is returned, as Process does). A call whose
// context ended while it waited in the queue is never sent and answers
// ctx.Err() when the next pipeline leaves; one already on its way is
// answered by its pipeline (bounded by the earliest deadline in it, and
// the client's own timeouts).
func (p *Pipe) process(ctx context.Context, c Pipeliner, timeout time.Duration, cmd redis.Cmder) error {
	call := waitedCalls.Get().(*pipeCall)
	call.ctx, call.cmd, call.deadline = ctx, cmd, time.Now().Add(timeout)
	defer call.recycle()
	if d, ok := ctx.Deadline(); ok && d.Before(call.deadline) {
		call.deadline = d
	}
	p.mu.Lock()
	if p.inflight < PipeInFlight {
		p.inflight++
		p.mu.Unlock()
		call.state.Store(pipeTaken)
		p.lead(c, call)
		return cmd.Err()
	}
	p.queue = append(p.queue, call)
	p.mu.Unlock()
	// No wait on ctx (its Done channel costs an allocation per call): a
	// call whose context ended meanwhile is answered unsent as soon as the
	// next pipeline leaves, at most a pipeline's round trip later.
	<-call.wake
	if call.lead {
		p.lead(c, call)
	}
	return cmd.Err()
}

// waitedCalls are the calls of process, reused (recycle): a call and its
// wake channel are two allocations every queued call would make otherwise.
var waitedCalls = sync.Pool{New: func() any { return &pipeCall{wake: make(chan struct{}, 1)} }}

// recycle puts a call of process back once its caller has its answer:
// the pipe holds it no more (a call leaves the queue before it is woken,
// and whoever wakes it reads nothing of it afterwards).
func (c *pipeCall) recycle() {
	c.ctx, c.cmd, c.lead = nil, nil, false
	c.state.Store(pipePending)
	waitedCalls.Put(c)
}

// lead sends own (taken already) with what waits in the queue, then hands
// the queue on to a waiting caller, or ends one pipeline in flight. The
// calls nobody waits for (own too, when it is one) then run their done:
// on this goroutine when own is one of them (a goroutine of the pipe's),
// else on one spawned for them all, so that the caller's answer does not
// wait for theirs.
func (p *Pipe) lead(c Pipeliner, own *pipeCall) {
	var batch, detached []*pipeCall
	defer func() {
		r := recover()
		if r != nil {
			// A hook of the client panicked: every call of the batch gets
			// the panic as its error, and the panic goes on in the
			// leader's own call (whose caller, or spawn, logs it) once the
			// others are answered and the queue is handed on.
			err := fmt.Errorf("redisdlm: panic sending a pipeline: %v", r)
			for _, call := range batch {
				if call.cmd.Err() == nil {
					call.cmd.SetErr(err)
				}
			}
		}
		for _, call := range batch {
			switch {
			case call.done != nil:
				if call != own {
					detached = append(detached, call)
				}
			case call != own:
				call.wake <- struct{}{}
			}
		}
		if next := p.handOn(); next != nil {
			p.spawnLead(next)
		}
		switch {
		case own.done != nil:
			own.done()
			runDone(detached)
		case len(detached) > 0:
			detached[0].spawn(func() { runDone(detached) })
		}
		if r != nil {
			panic(r)
		}
	}()
	if p.waiting() {
		// Let the requests running right now reach their call first: they
		// join this pipeline instead of the next (with nothing else to
		// run, this returns at once).
		runtime.Gosched()
	}
	batch, detached = p.take(own)
	switch len(batch) {
	case 0:
		return
	case 1:
		// A context that ends at the deadline, not only one that reports
		// it: go-redis waits on Done for a pooled connection and for a
		// new one, and only the socket's reads and writes take the
		// deadline itself.
		ctx, cancel := context.WithDeadline(batch[0].ctx, batch[0].deadline)
		defer cancel()
		_ = c.Process(ctx, batch[0].cmd)
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), latestDeadline(batch))
	defer cancel()
	pipe := c.Pipeline()
	for _, call := range batch {
		_ = pipe.Process(ctx, call.cmd)
	}
	_, _ = pipe.Exec(ctx) // each command holds its own answer or error
}

// waiting reports whether calls wait in the queue.
func (p *Pipe) waiting() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queue) > 0
}

// spawnLead has a goroutine started to send call, one nobody waits for
// (taken already), with what waits in the queue.
func (p *Pipe) spawnLead(call *pipeCall) {
	call.spawn(func() { p.lead(call.c, call) })
}

// runDone runs the done of calls nobody waits for.
func runDone(calls []*pipeCall) {
	for _, call := range calls {
		call.done()
	}
}

// take makes the batch: own and the queued calls, up to pipeMax. A call
// whose context ended or whose own deadline passed while it waited is
// answered at once with that error, unsent (expired: those of them nobody
// waits for, whose done is still to run).
func (p *Pipe) take(own *pipeCall) (batch, expired []*pipeCall) {
	batch = make([]*pipeCall, 0, 1+p.Queued())
	now := time.Now()
	if err := own.expired(now); err != nil {
		own.cmd.SetErr(err)
	} else {
		batch = append(batch, own)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for n < len(p.queue) && len(batch) < pipeMax {
		call := p.queue[n]
		n++
		if !call.state.CompareAndSwap(pipePending, pipeTaken) {
			continue
		}
		if err := call.expired(now); err != nil {
			call.cmd.SetErr(err)
			if call.done != nil {
				expired = append(expired, call)
			} else {
				call.wake <- struct{}{}
			}
			continue
		}
		batch = append(batch, call)
	}
	p.dropFront(n)
	return batch, expired
}

// handOn makes the first waiting call of the queue send it, or ends a
// pipeline in flight when none waits. It returns that call when nobody
// waits for it: the caller of handOn then has a goroutine started to send
// it (not under the pipe's mutex).
func (p *Pipe) handOn() (detached *pipeCall) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.queue) > 0 {
		next := p.queue[0]
		p.dropFront(1)
		if next.state.CompareAndSwap(pipePending, pipeTaken) {
			if next.done != nil {
				return next
			}
			next.lead = true
			next.wake <- struct{}{}
			return nil
		}
	}
	if cap(p.queue) > pipeMax {
		p.queue = nil // a burst made it large
	}
	p.inflight--
	return nil
}

// dropFront removes the queue's first n calls (p.mu held). The rest move
// down, so the queue keeps its room for the next calls (a new one would
// grow again, call by call), and the slots left behind are cleared: an
// idle queue keeps no answered call alive.
func (p *Pipe) dropFront(n int) {
	rest := copy(p.queue, p.queue[n:])
	clear(p.queue[rest:])
	p.queue = p.queue[:rest]
}

// latestDeadline is the latest deadline of the calls: at most the timeout
// from now, since every call of the batch came before now. Not the
// earliest: a call that waited long in the queue (behind a pipeline Redis
// was slow to answer) would cut the time of every other call of the batch
// to what it had left; it gets at most the timeout more, from the moment
// its pipeline leaves.
func latestDeadline(batch []*pipeCall) time.Time {
	last := batch[0].deadline
	for _, call := range batch[1:] {
		if call.deadline.After(last) {
			last = call.deadline
		}
	}
	return last
}

// expired is the error of a call that must not be sent any more: its
// context ended, or its deadline passed while it waited.
func (c *pipeCall) expired(now time.Time) error {
	if err := c.ctx.Err(); err != nil {
		return err
	}
	if !now.Before(c.deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

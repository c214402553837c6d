package lock

// A Locker: Acquire, one waiter's turn in the local queue, its attempts,
// wake-ups and polls with backoff, and this instance's place in the Redis
// wait lists.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Locker takes locks on one Redis server or a Redlock quorum of servers.
type Locker struct {
	servers []*Server
	quorum  int
	opts    Options
	dom     *domain
	logger  *slog.Logger
	argv    constArgv
	// spawn runs a function of a server's pipe (a release nobody waits
	// for) in the background, a panic in it logged (redisconn.Sender).
	spawn func(func())
}

// constArgv are the acquire script's arguments that never change for a
// locker, boxed once instead of per call.
type constArgv struct {
	ttlMs, permits, self, life, delayMs, replayMs any
}

// newLocker is New.
func newLocker(servers []*Server, opts Options, logger *slog.Logger) *Locker {
	ids := make([]string, len(servers))
	for i, s := range servers {
		ids[i] = s.id
	}
	if opts.Clock == nil {
		opts.Clock = realClock{}
	}
	domKey := fmt.Sprintf("%s|ttl=%d|permits=%d|sync=%d|delay=%d|replay=%t", strings.Join(ids, ","), opts.TTL, opts.Permits, opts.SyncReplicas, opts.LockDelay, opts.Replay > 0)
	l := &Locker{
		servers: servers,
		quorum:  len(servers)/2 + 1,
		opts:    opts,
		dom:     acquireDomain(domKey),
		logger:  logger,
	}
	l.argv = constArgv{ttlMs: opts.TTL.Milliseconds(), permits: opts.Permits, self: l.dom.id,
		life: l.waitqLife().Milliseconds(), delayMs: opts.LockDelay.Milliseconds(), replayMs: opts.Replay.Milliseconds()}
	l.spawn = func(f func()) {
		background.Go(func() {
			defer l.recoverPanic("sending a release nobody waits for")
			f()
		})
	}
	return l
}

// close drops this locker's reference to its shared queue domain.
func (l *Locker) close() { releaseDomain(l.dom) }

func (l *Locker) acquire(ctx context.Context, keys []string, run *Run) (*Lease, error) {
	q := l.dom.queue(keys)
	w, ok := q.enqueue(l.opts.MaxWaiters)
	if !ok {
		l.dom.putQueue(q)
		return nil, newBusy(ErrTooManyWaiters, q.retryHint(), q.waiting())
	}
	l.useServers()
	ls, err := l.wait(ctx, q, w, keys, run)
	if err != nil {
		var busy *BusyError
		if errors.As(err, &busy) {
			busy.ahead = q.position(w)
		}
	}
	// Leave the queue; a lease handed on just as the wait ended is taken
	// when the caller still wants it, and passed on otherwise.
	extra := q.leave(w)
	w.recycle()
	if extra != nil {
		if ls == nil && ctx.Err() == nil {
			ls, err = extra, nil
		} else {
			extra.Release()
		}
	}
	if ls == nil {
		leave := q.empty()
		l.dom.putQueue(q)
		if leave {
			// Nobody here waits any more: give up this instance's turn in
			// Redis. The servers stay in use until that is done, so a
			// reload cannot close their clients first.
			go l.leaveWaitq(keys)
		} else {
			l.unuseServers()
		}
		return nil, err
	}
	if !ls.chained {
		q.acquired()
	}
	q.setRetryHint(busyFacts{at: time.Now(), leaseLeft: ls.Valid(), held: time.Since(ls.Granted())})
	// The queue and server references taken above now belong to the lease.
	ls.q, ls.owned = q, true
	return ls, nil
}

func (l *Locker) useServers() {
	for _, s := range l.servers {
		s.conn.Use()
	}
}

func (l *Locker) unuseServers() {
	for _, s := range l.servers {
		s.conn.Unuse()
	}
}

// wait runs one waiter's turn: queue, attempts, wake-ups and polls.
func (l *Locker) wait(ctx context.Context, q *keyQueue, w *waiter, keys []string, run *Run) (*Lease, error) {
	wt := &waiting{l: l, ctx: ctx, q: q, w: w, keys: keys, run: run, last: unknownBusy}
	if l.opts.Wait > 0 {
		wt.end = time.Now().Add(l.opts.Wait)
		defer wt.stopDeadline()
	}
	if ls, err := wt.awaitTurn(); ls != nil || err != nil {
		return ls, err
	}
	if err := wt.awaitOwnRelease(); err != nil {
		return nil, err
	}
	for n := 0; ; n++ {
		ls, next, err := wt.step(n)
		switch next {
		case stepDone:
			return ls, err
		case stepAgain:
			continue
		}
		if ls, err := wt.pause(n); ls != nil || err != nil {
			return ls, err
		}
	}
}

// waiting is one waiter's turn in progress.
type waiting struct {
	l         *Locker
	ctx       context.Context
	q         *keyQueue
	w         *waiter
	keys      []string
	run       *Run        // nil: no run record
	end       time.Time   // the end of the wait; zero with wait 0
	deadlineT *time.Timer // fires at end; made when the waiter first waits

	local      bool          // this instance holds every permit
	retryAfter time.Duration // the last attempt's: until the earliest lease ends
	last       busyFacts     // what the last busy attempt learned
	took       time.Duration // how long the last attempt took
	busyKey    int
	split      bool // the last attempt took part of what it needed
	subscribed bool
}

// deadline fires at the end of the wait (never with wait 0). Its timer is
// made at the first wait: a request that gets the lock at once, as most
// do, makes none.
func (wt *waiting) deadline() <-chan time.Time {
	if wt.end.IsZero() {
		return nil
	}
	if wt.deadlineT == nil {
		wt.deadlineT = time.NewTimer(time.Until(wt.end))
	}
	return wt.deadlineT.C
}

func (wt *waiting) stopDeadline() {
	if wt.deadlineT != nil {
		wt.deadlineT.Stop()
	}
}

// waitStep is what follows one step of a wait.
type waitStep int

const (
	stepPause waitStep = iota // wait for a wake-up or the next poll
	stepAgain                 // try again at once
	stepDone                  // the wait is over: a lease or an error
)

// busy is the error of a wait that ran out (or of wait 0).
func (wt *waiting) busy(f busyFacts) error {
	return newBusy(ErrNotObtained, f, 0)
}

// awaitTurn waits until this waiter heads the queue (first come, first
// served), or is handed a lease by the previous holder (returned), or the
// wait ends (its error).
func (wt *waiting) awaitTurn() (*Lease, error) {
	if wt.w.head() {
		return nil, nil
	}
	if wt.l.opts.Wait <= 0 {
		return nil, wt.busy(wt.q.retryHint())
	}
	select {
	case <-wt.w.turn:
		return nil, nil
	case g := <-wt.w.grant:
		return g, nil
	case <-wt.ctx.Done():
		return nil, wt.ctx.Err()
	case <-wt.deadline():
		return nil, wt.busy(wt.q.retryHint())
	}
}

// awaitOwnRelease waits (up to one call's timeout) for a lease of these
// keys that this instance gave back a moment ago: it may still be on its
// way to Redis (it is released in the background, after the answer), and
// this request must not find the lock held by the request before it.
func (wt *waiting) awaitOwnRelease() error {
	done := wt.q.releaseDone()
	if done == nil {
		return nil
	}
	t := time.NewTimer(wt.l.opts.Timeout)
	defer t.Stop()
	select {
	case <-done:
		// That release also woke this waiter; the attempt that follows
		// comes after it, so the wake-up is spent.
		select {
		case <-wt.w.wake:
		default:
		}
	case <-t.C:
	case <-wt.ctx.Done():
		return wt.ctx.Err()
	}
	return nil
}

// step makes the n-th attempt. While this instance itself holds every
// permit, its holder hands the lease on or wakes this waiter: the first
// attempt is skipped, and the polls are only the safety net (a holder that
// lost its lease). With wait 0 the one attempt is made all the same: its
// busy answer brings the other instances waiting (Retry-After).
func (wt *waiting) step(n int) (*Lease, waitStep, error) {
	l := wt.l
	wt.local = wt.q.heldLocally(l.opts.Permits)
	if n == 0 && wt.local && l.opts.Wait > 0 {
		return nil, stepPause, nil
	}
	mine := wt.q.retryHint() // with local: of the holder here
	began := time.Now()
	a := l.tryAcquire(wt.ctx, wt.keys, wt.run, l.chainSize(wt.q, wt.keys), wt.busyKey)
	wt.took = time.Since(began)
	switch {
	case a.err != nil && wt.ctx.Err() != nil:
		return nil, stepDone, wt.ctx.Err()
	case a.err != nil:
		return nil, stepDone, a.err
	case a.lease != nil:
		return a.lease, stepDone, nil
	case a.answer != "":
		return nil, stepDone, &Replayed{answer: a.answer}
	case a.runRefused != nil:
		return nil, stepDone, a.runRefused
	}
	wt.retryAfter, wt.busyKey, wt.split, wt.last = a.retryAfter, a.busyKey, a.split, a.busy
	if wt.local && mine.held >= 0 && (wt.last.held < 0 || mine.held < wt.last.held) {
		// A lease handed on here is news to Redis: its holder started at
		// the hand-off.
		wt.last.held = mine.held
	}
	wt.q.setRetryHint(wt.last)
	switch {
	case wt.ctx.Err() != nil:
		return nil, stepDone, wt.ctx.Err()
	case l.opts.Wait <= 0:
		return nil, stepDone, wt.busy(wt.last)
	case !wt.subscribed:
		// Subscribe, then try once more: a release between the failed
		// attempt and the subscription would otherwise go unnoticed.
		wt.subscribed = true
		if l.subscribe(wt.ctx) {
			return nil, stepAgain, nil
		}
	}
	return nil, stepPause, nil
}

// pause waits for a wake-up, a lease handed on (returned), the n-th poll
// delay, or the end of the wait (its error).
func (wt *waiting) pause(n int) (*Lease, error) {
	l, w := wt.l, wt.w
	d := l.backoff(n)
	if wt.local {
		d = l.opts.BackoffMax // only the safety net
	} else if wt.retryAfter > 0 && wt.retryAfter < d {
		d = wt.retryAfter + time.Millisecond
	}
	t := time.NewTimer(d)
	defer t.Stop()
	wake := w.wake
	for {
		select {
		case g := <-w.grant:
			return g, nil
		case <-wake:
			if !wt.split {
				return nil, nil
			}
			// The last attempt took part of what it needed: it met a
			// release half done, or a rival that took part too. Retry
			// after a random delay of about one attempt, so the release
			// is complete and two rivals woken by the same message do
			// not collide in step again.
			wake = nil
			t.Reset(rand.N(2*wt.took + time.Millisecond))
		case <-t.C:
			return nil, nil
		case <-wt.ctx.Done():
			return nil, wt.ctx.Err()
		case <-wt.deadline():
			return nil, wt.busy(wt.last)
		}
	}
}

// backoff returns the next poll delay with full jitter: uniform in
// [min, min(max, min·2^n)].
func (l *Locker) backoff(n int) time.Duration {
	lo, hi := l.opts.BackoffMin, l.opts.BackoffMin
	for i := 0; i < n && hi < l.opts.BackoffMax; i++ {
		hi *= 2
	}
	if hi > l.opts.BackoffMax {
		hi = l.opts.BackoffMax
	}
	if hi <= lo {
		return lo
	}
	return lo + rand.N(hi-lo+1)
}

// chainSize is how many fencing tokens an acquisition reserves: one per
// holder it may serve by local hand-off (single key, one permit only).
func (l *Locker) chainSize(q *keyQueue, keys []string) int {
	if len(keys) != 1 || l.opts.Permits != 1 || l.opts.Replay > 0 {
		return 1
	}
	n := q.waiting() // this waiter included
	if n > maxChain {
		n = maxChain
	}
	if n < 1 {
		n = 1
	}
	return n
}

// subscribe makes sure every server's wake-up listener runs, and reports
// whether a subscription became active just now (so the caller tries again).
func (l *Locker) subscribe(ctx context.Context) bool {
	fresh := false
	for _, s := range l.servers {
		if s.wake.ensure(ctx, l.opts.Timeout) {
			fresh = true
		}
	}
	return fresh
}

// waitqLife is how long an instance's place in a key's Redis wait list
// lasts without a new attempt (a waiter asks at least every backoff_max).
// The list tells a release whether another instance waits (only then is a
// wake-up published) and, where instances take turns, who goes next.
func (l *Locker) waitqLife() time.Duration {
	return 2*l.opts.BackoffMax + time.Second
}

// turns reports whether instances take turns on a key set: only a single
// key on one server. With Redlock, or several keys, the wait lists of
// different servers or keys could each favour another instance and nobody
// would win.
func (l *Locker) turns(keys int) bool {
	return len(l.servers) == 1 && keys == 1
}

func (l *Locker) turnsFlag(keys int) any { return flagArg(l.turns(keys)) }

// flagArg is a script's 0/1 argument, boxed once (not per call).
func flagArg(on bool) any {
	if on {
		return flagArgs[1]
	}
	return flagArgs[0]
}

var flagArgs = [2]any{"0", "1"}

// leaveWaitq removes this instance from the keys' Redis wait lists on
// every server at once, then gives back the servers that Acquire took.
func (l *Locker) leaveWaitq(keys []string) {
	defer l.unuseServers()
	defer l.recoverPanic("leaving the wait list")
	l.callAll(context.Background(), func(ctx context.Context, _ int, s *Server) (any, error) {
		cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
		defer cancel()
		var err error
		for _, k := range keys {
			zrem := redis.NewIntCmd(cctx, "zrem", WaitqKey(k), l.dom.id)
			if e := s.client.Process(cctx, zrem); e != nil {
				err = e
			}
		}
		return nil, err
	}, nil, nil)
}

// recoverPanic, deferred in a background goroutine, logs a panic with its
// stack and lets the process go on.
func (l *Locker) recoverPanic(what string) {
	if r := recover(); r != nil {
		l.logPanic(what, r)
	}
}

func (l *Locker) logPanic(what string, r any) {
	if l.logger != nil {
		l.logger.Error("panic in the lock engine; recovered", slog.String("while", what), slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
	}
}

// clients is Clients.
func (l *Locker) clients() []redis.UniversalClient {
	out := make([]redis.UniversalClient, len(l.servers))
	for i, s := range l.servers {
		out[i] = s.conn.Client
	}
	return out
}

// queuedCalls is QueuedCalls.
func (l *Locker) queuedCalls() int {
	n := 0
	for _, s := range l.servers {
		n += s.pipe.Queued()
	}
	return n
}

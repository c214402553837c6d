package lock

// A held lease: handing it on to the next local waiter, renewing its block
// of fencing tokens, keeping it alive while its request runs, releasing it.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// maxChain bounds how many holders in a row one Redis acquisition may serve
// by local hand-off; then the lock is released in Redis, so waiters of other
// instances get their turn.
const maxChain = 16

// Lease is one held acquisition of a set of keys.
type Lease struct {
	l     *Locker
	keys  []string // sorted Redis lock keys
	token string
	fence int64     // fencing token: strictly increases per key with every acquisition
	start time.Time // when the lock was granted
	mu    sync.Mutex
	until time.Time // validity end as this process sees it
	done  bool
	// q is the local queue of the key set. The lease holds a reference to
	// it, and to its servers, from Acquire until release (owned), so waiters
	// that arrive meanwhile queue where the hand-off looks for them, and the
	// servers' clients stay open for the release.
	q     *keyQueue
	owned bool
	// released is set before the release is sent, so a server that grants
	// this token late releases it again (see tryAcquire); removed has bit i
	// set once server i's release answered that it removed the token, so a
	// late grant there needs no second release.
	released *atomic.Bool
	removed  *atomic.Uint64
	// unknown is set when a server's answer to the acquire was lost (a
	// minority of a Redlock): that acquire may still reach it, so the
	// release marks the token dead there too.
	unknown *atomic.Bool
	// extending counts the calls of extensions still on their way to a
	// Redlock member (shared along a chain of hand-offs, like unknown): an
	// extension that reaches a member restarted empty after the release
	// would re-create the lease there, so a release that starts while one
	// is on its way marks the token dead, and the extend script never
	// extends a dead token.
	extending *atomic.Int32
	// chainLeft counts the fencing tokens reserved for handing this lease on
	// to waiters of this instance without a Redis call.
	chainLeft int
	chained   bool // received by hand-off, not from Redis
	renewing  *renewal
	raise     int64 // Redlock: fencing counter to write back on release
	lost      atomic.Bool
}

// Valid reports the remaining validity of the lease.
func (ls *Lease) Valid() time.Duration {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return time.Until(ls.until)
}

func (ls *Lease) validUntil() time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.until
}

func (ls *Lease) setUntil(t time.Time) {
	ls.mu.Lock()
	ls.until = t
	ls.mu.Unlock()
}

// markLost records that the lease is gone, so it is not handed on.
func (ls *Lease) markLost() { ls.lost.Store(true) }

// Release gives the lease back on every server and wakes the next local
// waiter — or hands it on to that waiter without a Redis call. It is safe
// to call more than once.
func (ls *Lease) Release() { ls.releaseWith("", false) }

// releaseWith releases the lease; a non-empty answer is stored for replay
// in the same script (and then the lease is never handed on locally: the
// waiters are woken and find the answer).
//
// With background, the Redis round trip runs after releaseWith returns,
// so a response is not held up by it: the hand-off to a local
// waiter still happens at once, and a request of this instance that comes
// for the keys meanwhile waits for the release before its first attempt
// (keyQueue.releaseDone), so a client's next request never finds its own
// previous one still holding the lock.
func (ls *Lease) releaseWith(answer string, background bool) {
	ls.mu.Lock()
	if ls.done {
		ls.mu.Unlock()
		return
	}
	ls.done = true
	ls.mu.Unlock()
	if answer == "" && ls.handOff() {
		ls.dropRefs()
		// The next holder waits in this P's run-next slot: let it run now
		// rather than after this request's own wind-down.
		runtime.Gosched()
		return
	}
	if ls.released != nil {
		ls.released.Store(true)
	}
	if ls.q != nil {
		ls.q.releaseStarted()
	}
	if background {
		go ls.releaseInRedis(answer)
	} else {
		ls.releaseInRedis(answer)
	}
}

// releaseInRedis runs the release on every server, then tells the local
// queue and wakes its head (also after a panic, or the queue's next
// waiters would each wait a timeout for a release that never ends).
func (ls *Lease) releaseInRedis(answer string) {
	defer ls.dropRefs()
	defer ls.releaseEnded()
	defer ls.l.recoverPanic("releasing a lease")
	ls.l.releaseKeys(ls.keys, ls.token, ls.raise, ls.removed, true, ls.outcomeUnknown(), answer)
}

// outcomeUnknown reports whether some server may hold the lease in a way
// nobody knows: an acquire or extension whose answer was lost, or an
// extension still on its way. Its release then marks the token dead.
func (ls *Lease) outcomeUnknown() bool {
	return (ls.extending != nil && ls.extending.Load() > 0) || (ls.unknown != nil && ls.unknown.Load())
}

// releaseEnded tells the local queue that the release in Redis is over and
// wakes its head.
func (ls *Lease) releaseEnded() {
	if ls.q == nil {
		ls.l.dom.wakeKeys(ls.keys)
		return
	}
	ls.q.released()
	ls.l.dom.wake(ls.q.wakeIDs) // hashed once, when the queue was made
}

// dropRefs gives back the lease's references to its queue and servers.
func (ls *Lease) dropRefs() {
	if ls.owned {
		ls.owned = false
		ls.l.dom.putQueue(ls.q)
		ls.l.unuseServers()
	}
}

// handOff passes the lease to the head of the local queue: the next holder
// takes over the Redis lease and the next reserved fencing token, with no
// Redis call. It reports false when the lease must be released in Redis
// instead (no tokens left and no renewal, lost, too little validity left,
// nobody waiting, or a waiter of another local queue sharing a key).
func (ls *Lease) handOff() bool {
	if ls.lost.Load() || ls.q == nil {
		return false
	}
	fence, left := ls.fence+1, ls.chainLeft
	if left <= 0 {
		// The block is used up: take the renewal started while this
		// holder worked, if it got one.
		r := ls.renewing
		if r == nil {
			return false
		}
		<-r.done
		if !r.ok {
			return false
		}
		fence, left = r.fence-int64(r.n)+1, r.n
		ls.setUntil(r.until)
	}
	if ls.Valid() < ls.l.opts.TTL/2 {
		return false
	}
	if ls.l.dom.othersWaiting(ls.q) {
		// A waiter of another local queue wants one of these keys (e.g.
		// {a,b} behind a chain of {a}): release in Redis, which wakes it,
		// or the chain would renew itself past it for ever.
		return false
	}
	q := ls.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) == 0 {
		return false
	}
	w := q.waiters[0]
	ls.mu.Lock()
	until := ls.until
	ls.mu.Unlock()
	next := &Lease{l: ls.l, keys: ls.keys, token: ls.token, fence: fence, start: time.Now(),
		until: until, q: q, released: ls.released, removed: ls.removed, unknown: ls.unknown, extending: ls.extending, chainLeft: left - 1, chained: true, raise: ls.raise}
	if next.chainLeft == 0 && len(q.waiters) > 1 && ls.l.turns(len(ls.keys)) {
		// The next holder is the block's last and more wait behind it: ask
		// Redis for another block while it works. Renewal needs the
		// instances' turns (to step aside for another instance): one key on
		// one server.
		n := len(q.waiters) - 1
		if n > maxChain {
			n = maxChain
		}
		next.renewing = ls.l.renew(next, n)
	}
	select {
	case w.grant <- next:
		return true
	default: // already granted: cannot happen with one holder at a time
		return false
	}
}

// renewal is a lease renewal in flight: another block of fencing tokens
// for local hand-offs, granted only while no other instance waits.
type renewal struct {
	done  chan struct{}
	ok    bool
	fence int64 // the block's last token
	n     int
	until time.Time
}

// renew asks Redis, in the background, to extend ls and reserve n tokens.
func (l *Locker) renew(ls *Lease, n int) *renewal {
	r := &renewal{done: make(chan struct{}), n: n}
	go func() {
		defer close(r.done)
		defer l.recoverPanic("renewing a lease")
		ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
		defer cancel()
		start := time.Now()
		k := ls.keys[0]
		v, err := renewScript.Run(ctx, l.servers[0].client, []string{k, FenceKey(k), WaitqKey(k)},
			ls.token, l.opts.TTL.Milliseconds(), l.dom.id, n).Int64Slice()
		if err == nil && len(v) == 2 && v[0] == 1 {
			r.ok, r.fence, r.until = true, v[1], start.Add(l.opts.TTL)
		}
	}()
	return r
}

// extend renews ls for another ttl on every server; it counts only with a
// majority, and only while the lease is valid: an extension that starts,
// or is answered, after the lease's validity ended is a lost lease in
// every mode (the lease may have lapsed and been taken by a rival
// meanwhile; it is never revived).
//
// The decision comes as soon as a majority answered; the calls to the
// other servers go on within the timeout, so a Redlock member that
// restarted empty gets the lease back in this round, not the next. Such a
// call may still be on its way when the lease is released, or its answer
// may be lost: both mark the lease's outcome unknown for its release (see
// lease.extending).
func (l *Locker) extend(ctx context.Context, ls *Lease) error {
	start := time.Now()
	prev := ls.validUntil()
	if !start.Before(prev) {
		return fmt.Errorf("%w: its validity ended %s before it could be extended (this process or redis was paused or slow)", ErrLeaseLost, start.Sub(prev).Round(time.Millisecond))
	}
	recreate := "0"
	if len(l.servers) > 1 {
		recreate = "1"
	}
	track := recreate == "1" && ls.extending != nil && ls.unknown != nil
	for _, k := range ls.keys {
		if track {
			ls.extending.Add(int32(len(l.servers)))
		}
		results := l.callAll(ctx, func(ctx context.Context, _ int, s *Server) (any, error) {
			if track {
				defer ls.extending.Add(-1) // after unknown is stored
			}
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.Timeout)
			defer cancel()
			v, err := ExtendScript.Run(cctx, s.client, []string{k, FenceKey(k), DeadKey(k)}, ls.token, l.opts.TTL.Milliseconds(), l.opts.Permits, recreate).Int64()
			if track && unknownOutcome(err) {
				ls.unknown.Store(true)
			}
			return v, err
		}, func(res []result, _ int) bool {
			ok, bad := 0, 0
			for _, r := range res {
				if r.done && r.err == nil && r.v.(int64) == 1 {
					ok++
				} else if r.done {
					bad++
				}
			}
			return ok >= l.quorum || bad > len(res)-l.quorum
		}, nil)
		ok, errs := 0, 0
		var lastErr error
		for _, r := range results {
			switch {
			case !r.done:
			case r.err != nil:
				errs++
				lastErr = r.err
			case r.v.(int64) == 1:
				ok++
			}
		}
		if ok < l.quorum {
			if errs > 0 && ok+errs >= l.quorum {
				// Not refused by a majority: Redis is unreachable; the lease
				// may still hold until it runs out.
				return fmt.Errorf("%w: extending: %v", ErrUnavailable, lastErr)
			}
			return ErrLeaseLost
		}
	}
	if now := time.Now(); now.After(prev) {
		return fmt.Errorf("%w: the extension was answered %s after the lease's validity ended", ErrLeaseLost, now.Sub(prev).Round(time.Millisecond))
	}
	validity := l.opts.TTL - time.Since(start)
	if len(l.servers) > 1 {
		validity -= l.drift()
	}
	if validity <= 0 {
		return fmt.Errorf("%w: extension took longer than the lease", ErrLeaseLost)
	}
	ls.setUntil(start.Add(validity))
	return nil
}

// keeper keeps one lease alive while its request runs. It is driven by a
// timer, not a goroutine of its own, so a request that ends before the
// first extension costs no goroutine start or join on the hand-off path.
type keeper struct {
	ls      *Lease
	extend  bool          // auto_extend
	maxHold time.Duration // stop extending after this long (0: never)
	onLost  func(error)

	mu      sync.Mutex
	t       *time.Timer
	stopped bool
	running bool
	cancel  context.CancelFunc
	done    chan struct{} // closed by a running fire that finds the keeper stopped
}

// keep starts keeping the lease: with extend, it is extended every ttl/3
// (owner-checked) until stop or maxHold; a lease that is not extended (any
// more) is reported lost when its validity ends. onLost runs at most once.
func (ls *Lease) keep(extend bool, maxHold time.Duration, onLost func(error)) *keeper {
	k := &keeper{ls: ls, extend: extend, maxHold: maxHold, onLost: onLost, done: make(chan struct{})}
	k.mu.Lock()
	k.t = time.AfterFunc(k.next(), k.fire)
	k.mu.Unlock()
	return k
}

// next is the delay to the next timer event.
func (k *keeper) next() time.Duration {
	if k.extendNow() {
		every := k.ls.l.opts.TTL / 3
		if v := k.ls.Valid() / 2; v < every {
			every = v // a handed-on lease may have less than a full ttl left
		}
		if every < time.Millisecond {
			every = time.Millisecond
		}
		return every
	}
	if v := k.ls.Valid(); v > 0 {
		return v
	}
	return 0
}

func (k *keeper) extendNow() bool {
	return k.extend && (k.maxHold <= 0 || time.Since(k.ls.start) < k.maxHold)
}

func (k *keeper) fire() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	k.running = true
	ctx, cancel := context.WithCancel(context.Background())
	k.cancel = cancel
	k.mu.Unlock()

	var lost error
	func() {
		defer k.ls.l.recoverPanic("keeping a lease alive")
		if !k.extendNow() {
			if k.ls.Valid() <= 0 {
				lost = fmt.Errorf("%w: the lease ran out before the request ended (ttl %s, max_hold %s)", ErrLeaseLost, k.ls.l.opts.TTL, k.maxHold)
			}
			return
		}
		err := k.ls.l.extend(ctx, k.ls)
		switch {
		case err == nil || ctx.Err() != nil:
		case errors.Is(err, ErrLeaseLost):
			lost = err
		case k.ls.Valid() <= 0:
			lost = fmt.Errorf("%w: %v", ErrLeaseLost, err)
		}
	}()
	cancel()

	k.mu.Lock()
	defer k.mu.Unlock()
	k.running = false
	if k.stopped {
		close(k.done)
		return
	}
	if lost != nil {
		k.stopped = true
		k.ls.markLost()
		k.onLost(lost)
		return
	}
	d := k.next()
	if !k.extendNow() && d <= 0 {
		d = time.Millisecond
	} else if k.ls.Valid() < k.ls.l.opts.TTL/3 {
		// Redis did not answer: try again sooner while the lease may hold.
		if d > k.ls.Valid()/3 {
			d = k.ls.Valid() / 3
		}
		if d < 10*time.Millisecond {
			d = 10 * time.Millisecond
		}
	}
	k.t.Reset(d)
}

// stop ends the keeping and waits for an extension in flight to be
// decided. With Redlock, its calls to a minority may still be on their way
// after that: the release that comes next marks the token dead then, so
// none of them can re-create the lease (see lease.extending).
func (k *keeper) stop() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	k.stopped = true
	k.t.Stop()
	running := k.running
	if running && k.cancel != nil {
		k.cancel()
	}
	k.mu.Unlock()
	if running {
		<-k.done
	}
}

package lock

// A held lease: handing it on to the next local waiter, releasing it.

import (
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
	names names    // of a lease of one key: its key's names (zero with several keys)
	// keeper is the lease's first Keep's (kept once it is taken).
	keeper keeper
	kept   atomic.Bool
	token  string
	fence  int64     // fencing token: strictly increases per key with every acquisition
	start  time.Time // when the lock was granted
	mu     sync.Mutex
	until  time.Time // validity end as this process sees it
	done   bool
	// ending: HandOffNow found no waiter to hand the lease to and
	// announced its release, which the next release call sends.
	ending bool
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
	// inflight counts the calls still on their way to a Redlock member
	// (shared along a chain of hand-offs, like unknown): acquires whose
	// answer had not come when a majority decided, and extensions. A
	// release can overtake them (another connection): an acquire that
	// reaches a member after the lease's release there would take it again,
	// and an extension that reaches a member restarted empty would
	// re-create it. So a release that starts while one is on its way marks
	// the token dead, and neither script grants or extends a dead token.
	inflight *atomic.Int32
	// chainLeft counts the fencing tokens reserved for handing this lease on
	// to waiters of this instance without a Redis call.
	chainLeft int
	// reserved is when the block of chainLeft's tokens was asked for: its
	// tokens carry Redis TIME of about then as their floor, so a handed-on
	// token is as old as its block (see handOff).
	reserved time.Time
	chained  bool // received by hand-off, not from Redis
	renewing *renewal
	raise    int64 // Redlock: fencing counter to write back on release
	lost     atomic.Bool
	unclean  atomic.Bool // abandoned: the holder did not finish cleanly
	// run: taken by AcquireRun, so the grant wrote a run record; clearRun:
	// its release deletes it (ClearRun).
	run      bool
	clearRun atomic.Bool
}

// valid is the lease's remaining validity by the engine's clock.
func (ls *Lease) valid() time.Duration {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.until.Sub(ls.l.now())
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

// releaseMode says when a release's Redis round trip runs.
type releaseMode int

const (
	releaseNow          releaseMode = iota // before releaseWith returns
	releaseInBackground                    // after it
)

// releaseWith releases the lease; a non-empty answer is stored for replay
// in the same script (and then the lease is never handed on locally: the
// waiters are woken and find the answer).
//
// With releaseInBackground, the Redis round trip runs after releaseWith returns,
// so a response is not held up by it: the hand-off to a local
// waiter still happens at once, and a request of this instance that comes
// for the keys meanwhile waits for the release before its first attempt
// (keyQueue.releaseDone), so a client's next request never finds its own
// previous one still holding the lock.
func (ls *Lease) releaseWith(answer string, mode releaseMode) {
	ls.mu.Lock()
	if ls.done && !ls.ending {
		ls.mu.Unlock()
		return
	}
	announced := ls.ending // HandOffNow did what comes before the Redis call
	ls.done, ls.ending = true, false
	ls.mu.Unlock()
	if !announced {
		if answer == "" && ls.handedOn() {
			return
		}
		ls.announceRelease()
	}
	if mode == releaseInBackground {
		if !ls.releaseDetached(answer) {
			background.Go(func() { ls.releaseInRedis(answer) })
		}
	} else {
		ls.releaseInRedis(answer)
	}
}

// handOffNow is HandOffNow: what releaseWith does before its Redis call.
func (ls *Lease) handOffNow() bool {
	ls.mu.Lock()
	if ls.done {
		ls.mu.Unlock()
		return false
	}
	ls.done = true
	ls.mu.Unlock()
	if ls.handedOn() {
		return true
	}
	ls.announceRelease()
	ls.mu.Lock()
	ls.ending = true
	ls.mu.Unlock()
	return false
}

// handedOn hands the lease on to a local waiter (handOff), and reports
// whether it did.
func (ls *Lease) handedOn() bool {
	if !ls.handOff() {
		return false
	}
	ls.dropRefs()
	// The next holder waits in this P's run-next slot: let it run now
	// rather than after this request's own wind-down.
	runtime.Gosched()
	return true
}

// announceRelease marks the lease as being released: a late grant of its
// token is released again (see tryAcquire), and a request of this instance
// for its keys waits for the release before its first attempt.
func (ls *Lease) announceRelease() {
	if ls.released != nil {
		ls.released.Store(true)
	}
	if ls.q != nil {
		ls.q.releaseStarted()
	}
}

// releaseInRedis runs the release on every server, then tells the local
// queue and wakes its head (also after a panic, or the queue's next
// waiters would each wait a timeout for a release that never ends).
func (ls *Lease) releaseInRedis(answer string) {
	defer ls.dropRefs()
	defer ls.releaseEnded()
	defer ls.l.recoverPanic("releasing a lease")
	ls.l.releaseLease(ls.release(answer))
}

// releaseDetached is releaseInRedis for the lean case, a lease of one key
// on one server with no answer to store: the release leaves with the next
// pipeline and no goroutine waits for its answer (see redisconn.Sender).
// It reports false, doing nothing, for any other lease.
func (ls *Lease) releaseDetached(answer string) bool {
	if answer != "" || len(ls.keys) != 1 || len(ls.l.servers) != 1 {
		return false
	}
	d := &detachedRelease{ls: ls, job: ls.l.leaseJob(ls.release(answer), 0)}
	d.job.start(ls.l.servers[0], &d.call, ls.names, ls.l.spawn, d)
	return true
}

// detachedRelease is a release nobody waits for: the lease, its job, and
// the call's keys and arguments in one allocation.
type detachedRelease struct {
	ls   *Lease
	job  releaseJob
	call releaseCall
}

// settle is what releaseInRedis does once the server answered.
func (d *detachedRelease) settle(removed bool, err error) {
	ls := d.ls
	defer ls.dropRefs()
	defer ls.releaseEnded()
	defer ls.l.recoverPanic("releasing a lease")
	if err == nil && removed && ls.removed != nil {
		ls.removed.Or(1)
	}
	ls.l.settleRelease(0, d.job, result{v: removed, err: err, done: true})
}

// release is the release of the lease, storing answer ("" for none).
func (ls *Lease) release(answer string) leaseRelease {
	var msgs []string
	if ls.q != nil {
		msgs = ls.q.wakeMsgs
	}
	return leaseRelease{keys: ls.keys, msgs: msgs, token: ls.token, raise: ls.raise, removed: ls.removed,
		unknown: ls.outcomeUnknown(), answer: answer, unclean: ls.unclean.Load() || ls.lost.Load(),
		clearRun: ls.run && ls.clearRun.Load()}
}

// outcomeUnknown reports whether some server may hold the lease in a way
// nobody knows: an acquire or extension whose answer was lost, or an
// extension still on its way. Its release then marks the token dead.
func (ls *Lease) outcomeUnknown() bool {
	return (ls.inflight != nil && ls.inflight.Load() > 0) || (ls.unknown != nil && ls.unknown.Load())
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
// a block older than the ttl, nobody waiting, or a waiter of another local
// queue sharing a key).
func (ls *Lease) handOff() bool {
	if ls.lost.Load() || ls.q == nil || (ls.unclean.Load() && ls.l.opts.LockDelay > 0) {
		return false
	}
	if ls.l.opts.Replay > 0 {
		// Under replay the next waiter asks Redis: it may find the
		// answer stored, or the run record that refuses it.
		return false
	}
	fence, left, reserved := ls.fence+1, ls.chainLeft, ls.reserved
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
		fence, left, reserved = r.fence-int64(r.n)+1, r.n, r.asked
		ls.setUntil(r.until)
	}
	if ls.l.now().Sub(reserved) >= ls.l.opts.TTL {
		// A token's floor is its block's Redis TIME, and redis_fence
		// refuses tokens older than its retain: a handed-on token is
		// never more than one ttl older than its hold (long holds kept
		// alive by auto-extension would otherwise age a block by a hold
		// per holder). The next holder asks Redis for a fresh one.
		return false
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
	next := &Lease{l: ls.l, keys: ls.keys, names: ls.names, token: ls.token, fence: fence, start: ls.l.now(),
		until: until, q: q, released: ls.released, removed: ls.removed, unknown: ls.unknown, inflight: ls.inflight, chainLeft: left - 1, reserved: reserved, chained: true, raise: ls.raise}
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

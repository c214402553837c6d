package redisdlm

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
)

// This file is the lock engine: single server and Redlock quorum,
// acquire/extend/release, waiting (local FIFO queue, Pub/Sub wake-up,
// backoff poll) and fencing tokens. It knows nothing of HTTP.

var (
	//go:embed scripts/lock_acquire.lua
	acquireLua string
	//go:embed scripts/lock_extend.lua
	extendLua string
	//go:embed scripts/lock_release.lua
	releaseLua string
	//go:embed scripts/fence_raise.lua
	fenceRaiseLua string
	//go:embed scripts/lock_renew.lua
	renewLua string

	acquireScript    = redis.NewScript(acquireLua)
	extendScript     = redis.NewScript(extendLua)
	releaseScript    = redis.NewScript(releaseLua)
	fenceRaiseScript = redis.NewScript(fenceRaiseLua)
	renewScript      = redis.NewScript(renewLua)
)

// Sentinel errors of the lock engine; compare with errors.Is.
var (
	// ErrNotObtained: the lock stayed busy for the whole wait.
	ErrNotObtained = errors.New("redisdlm: lock not obtained")
	// ErrTooManyWaiters: max_waiters local waiters already queue for the key.
	ErrTooManyWaiters = errors.New("redisdlm: too many waiters")
	// ErrUnavailable: Redis (or a quorum of Redlock servers) could not be reached.
	ErrUnavailable = errors.New("redisdlm: redis unavailable")
	// ErrLeaseLost: an extension found that the lease is no longer held.
	ErrLeaseLost = errors.New("redisdlm: lease lost")
)

// wakeChannel is the one Pub/Sub channel per Redis server on which releases
// are announced; the message is "<domain id> <lock key>".
const wakeChannel = "redisdlm:wake"

// BusyError is returned (wrapping ErrNotObtained or ErrTooManyWaiters) when
// the lock could not be taken in time; RetryAfter estimates when it frees.
type BusyError struct {
	Err        error
	RetryAfter time.Duration
}

func (e *BusyError) Error() string { return e.Err.Error() }
func (e *BusyError) Unwrap() error { return e.Err }

// lockOptions configures a locker.
type lockOptions struct {
	TTL        time.Duration
	Wait       time.Duration
	BackoffMin time.Duration
	BackoffMax time.Duration
	Permits    int
	MaxWaiters int
	Timeout    time.Duration // bound of one Redis call
	// SyncReplicas > 0: WAIT for that many replicas before a lock counts.
	SyncReplicas int
}

// locker takes locks on one Redis server or a Redlock quorum of servers.
type locker struct {
	servers []*pooledClient
	quorum  int
	opts    lockOptions
	dom     *domain
}

// newLocker builds a locker over servers (1, 3, 5 or 7). It does not dial.
func newLocker(servers []*pooledClient, opts lockOptions) *locker {
	ids := make([]string, len(servers))
	for i, s := range servers {
		ids[i] = s.settings.poolKey()
	}
	return &locker{
		servers: servers,
		quorum:  len(servers)/2 + 1,
		opts:    opts,
		dom:     acquireDomain(strings.Join(ids, ",")),
	}
}

// close drops this locker's reference to its shared queue domain.
func (l *locker) close() { releaseDomain(l.dom) }

// drift is the clock-drift allowance of a Redlock lease: 1% of ttl + 2ms.
func (l *locker) drift() time.Duration { return l.opts.TTL/100 + 2*time.Millisecond }

// Lease is one held acquisition of a set of keys.
type Lease struct {
	l     *locker
	keys  []string // sorted Redis lock keys
	token string
	Fence int64     // fencing token: strictly increases per key with every acquisition
	Start time.Time // when the lock was granted
	mu    sync.Mutex
	until time.Time // validity end as this process sees it
	q     *keyQueue
	done  bool
	// released is set before the release is sent, so a server that grants
	// this token late releases it again (see tryAcquire); removed has bit i
	// set once server i's release answered that it removed the token, so a
	// late grant there needs no second release.
	released *atomic.Bool
	removed  *atomic.Uint64
	// chainLeft counts the fencing tokens reserved for handing this lease on
	// to waiters of this instance without a Redis call.
	chainLeft int
	chained   bool // received by hand-off, not from Redis
	renewing  *renewal
	raise     int64 // Redlock: fencing counter to write back on release
	lost      atomic.Bool
}

// maxChain bounds how many holders in a row one Redis acquisition may serve
// by local hand-off; then the lock is released in Redis, so waiters of other
// instances get their turn.
const maxChain = 16

// markLost records that the lease is gone, so it is not handed on.
func (ls *Lease) markLost() { ls.lost.Store(true) }

// handOff passes the lease to the head of the local queue: the next holder
// takes over the Redis lease and the next reserved fencing token, with no
// Redis call. It reports false when the lease must be released in Redis
// instead (no tokens left and no renewal, lost, too little validity left,
// nobody waiting).
func (ls *Lease) handOff() bool {
	if ls.lost.Load() || ls.q == nil {
		return false
	}
	fence, left := ls.Fence+1, ls.chainLeft
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
		ls.mu.Lock()
		ls.until = r.until
		ls.mu.Unlock()
	}
	if ls.Valid() < ls.l.opts.TTL/2 {
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
	next := &Lease{l: ls.l, keys: ls.keys, token: ls.token, Fence: fence, Start: time.Now(),
		until: until, q: q, released: ls.released, removed: ls.removed, chainLeft: left - 1, chained: true, raise: ls.raise}
	if next.chainLeft == 0 && len(q.waiters) > 1 && ls.l.waitqLife(len(ls.keys)) > 0 {
		// The next holder is the block's last and more wait behind it: ask
		// Redis for another block while it works. Renewal needs the
		// instances' wait list (to step aside for another instance), which
		// exists where waitqLife is on: one key on one server.
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
func (l *locker) renew(ls *Lease, n int) *renewal {
	r := &renewal{done: make(chan struct{}), n: n}
	go func() {
		defer close(r.done)
		ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
		defer cancel()
		start := time.Now()
		k := ls.keys[0]
		v, err := renewScript.Run(ctx, l.servers[0].client, []string{k, fenceKey(k), waitqKey(k)},
			ls.token, l.opts.TTL.Milliseconds(), l.dom.id, n).Int64Slice()
		if err == nil && len(v) == 2 && v[0] == 1 {
			r.ok, r.fence, r.until = true, v[1], start.Add(l.opts.TTL)
		}
	}()
	return r
}

// Valid reports the remaining validity of the lease.
func (ls *Lease) Valid() time.Duration {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return time.Until(ls.until)
}

func fenceKey(lockKey string) string { return lockKey + ":fence" }
func waitqKey(lockKey string) string { return lockKey + ":waitq" }

// waitqLife is how long an instance's place in a key's Redis wait list lasts
// without a new attempt. Instances take turns only on a single-key lock on
// one server: with Redlock, or several keys, the wait lists of different
// servers or keys could each favour another instance and nobody would win,
// so there it is 0 (off).
func (l *locker) waitqLife(keys int) time.Duration {
	if len(l.servers) > 1 || keys > 1 {
		return 0
	}
	return 2*l.opts.BackoffMax + time.Second
}

// attempt is the outcome of one acquisition attempt.
type attempt struct {
	lease      *Lease
	retryAfter time.Duration // when not acquired: until the earliest lease ends
	busyKey    int           // when not acquired: index of the busy key
	// split: the attempt took part of what it needed (some servers or some
	// keys) from a rival that did the same; both wait a random backoff
	// rather than the next wake-up, so they do not collide again in step.
	split bool
	err   error // Redis unreachable / no quorum
}

// callAll runs f on every server in parallel and returns the results in
// server order; decide is called after each result and may end the wait
// early (a majority decided) by returning true. Results that arrive after
// that go to late (if not nil) instead, so the caller can undo them.
func (l *locker) callAll(ctx context.Context, f func(ctx context.Context, c redis.UniversalClient) (any, error), decide func(res []result, n int) bool, late func(i int, r result)) []result {
	res := make([]result, len(l.servers))
	if len(l.servers) == 1 {
		v, err := f(ctx, l.servers[0].client)
		res[0] = result{v: v, err: err, done: true}
		return res
	}
	var mu sync.Mutex
	closed := false
	arrived := make(chan struct{}, len(l.servers))
	for i, s := range l.servers {
		go func(i int, c redis.UniversalClient) {
			v, err := f(ctx, c)
			r := result{v: v, err: err, done: true}
			mu.Lock()
			if closed {
				mu.Unlock()
				if late != nil {
					late(i, r)
				}
				return
			}
			res[i] = r
			mu.Unlock()
			arrived <- struct{}{}
		}(i, s.client)
	}
	for n := 1; n <= len(l.servers); n++ {
		<-arrived
		mu.Lock()
		stop := decide != nil && decide(res, n)
		if stop || n == len(l.servers) {
			closed = true
			out := append([]result(nil), res...)
			mu.Unlock()
			return out
		}
		mu.Unlock()
	}
	return res
}

type result struct {
	v    any
	err  error
	done bool
}

// tryAcquire makes one attempt on every key (sorted) and every server.
// All keys or none: when any key is busy, the keys taken are released.
//
// first is the index of the key that was busy last time: it is asked
// first, so a request for several keys does not take and give back its free
// keys again and again while one of them stays busy.
func (l *locker) tryAcquire(ctx context.Context, keys []string, chain, first int) attempt {
	token := uuid.NewString()
	start := time.Now()
	ttlMs := l.opts.TTL.Milliseconds()
	life := l.waitqLife(len(keys)).Milliseconds()
	n := len(l.servers)
	var fence int64
	// A server that grants after the outcome was decided must not keep a
	// lease nobody owns: it is released there as soon as its answer comes,
	// if the attempt failed or the lease is already released — unless that
	// server's release already removed it (its grant came first there).
	var failed atomic.Bool
	released, removed := new(atomic.Bool), new(atomic.Uint64)
	lateGrant := func(k string) func(i int, r result) {
		return func(i int, r result) {
			if r.err == nil && r.v.([]int64)[0] == 1 && (failed.Load() || released.Load()) &&
				(len(keys) > 1 || removed.Load()&(1<<i) == 0) {
				l.releaseOn(l.servers[i].client, k, token)
			}
		}
	}
	order := make([]string, 0, len(keys))
	if first > 0 && first < len(keys) {
		order = append(order, keys[first])
		order = append(order, keys[:first]...)
		order = append(order, keys[first+1:]...)
	} else {
		order = append(order, keys...)
	}
	for i, k := range order {
		// Ask every server at once; stop as soon as the outcome is decided.
		results := l.callAll(ctx, func(ctx context.Context, c redis.UniversalClient) (any, error) {
			keys := []string{k, fenceKey(k), waitqKey(k)}
			if l.opts.SyncReplicas > 0 {
				return l.acquireSynced(ctx, c, keys, token, ttlMs, life, chain)
			}
			cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
			defer cancel()
			return acquireScript.Run(cctx, c, keys, token, ttlMs, l.opts.Permits, l.dom.id, life, l.timeFloor(), chain).Int64Slice()
		}, func(res []result, _ int) bool {
			g, b, e := tally(res)
			return g >= l.quorum || b > n-l.quorum || e > n-l.quorum
		}, lateGrant(k))
		granted, busy, errs := tally(results)
		if granted >= l.quorum {
			var keyMax int64
			for _, r := range results {
				if r.done && r.err == nil && r.v.([]int64)[0] == 1 && r.v.([]int64)[1] > keyMax {
					keyMax = r.v.([]int64)[1]
				}
			}
			if keyMax > fence {
				fence = keyMax
			}
			continue
		}
		failed.Store(true)
		// Not taken: give back what this attempt took, everywhere at once.
		// On one server a refused key holds nothing; with Redlock a
		// minority may have granted it.
		undo := order[:i]
		if n > 1 {
			undo = order[:i+1]
		}
		if len(undo) > 0 {
			l.releaseKeys(undo, token, 0, removed, false)
		}
		if granted+busy < l.quorum {
			// Fewer than a majority answered at all: Redis is unreachable.
			var last error
			for _, r := range results {
				if r.err != nil {
					last = r.err
				}
			}
			if ctx.Err() != nil {
				return attempt{err: ctx.Err()}
			}
			return attempt{err: fmt.Errorf("%w: %d of %d servers failed: %v", ErrUnavailable, errs, n, last)}
		}
		var retry time.Duration
		for _, r := range results {
			if r.done && r.err == nil && r.v.([]int64)[0] == 0 {
				if d := time.Duration(r.v.([]int64)[1]) * time.Millisecond; d > retry {
					retry = d
				}
			}
		}
		busyIdx := 0
		for j, x := range keys {
			if x == k {
				busyIdx = j
			}
		}
		return attempt{retryAfter: retry, busyKey: busyIdx, split: granted > 0 || i > 0}
	}
	var raise int64
	if len(keys) == 1 && n > 1 {
		// Redlock: the highest counter goes back to the servers with the
		// release (in the same round trip), so the majority that sees the
		// key free next also sees the counter. A holder that dies before its
		// release leaves that to the time floor of the counters: the next
		// holder comes a full ttl later, so its token is higher unless the
		// servers' clocks disagree by more than the ttl.
		raise = fence
	} else if len(keys) > 1 {
		// Several keys: one token serves them all, so each key's counter
		// must reach it before the token is used (a max-register).
		if err := l.raiseFences(ctx, keys, fence); err != nil {
			failed.Store(true)
			l.releaseKeys(keys, token, 0, removed, false)
			return attempt{err: err}
		}
	}
	validity := l.opts.TTL - time.Since(start)
	if n > 1 {
		validity -= l.drift()
	}
	if validity <= 0 {
		failed.Store(true)
		l.releaseKeys(keys, token, 0, removed, false)
		return attempt{retryAfter: 0}
	}
	return attempt{lease: &Lease{l: l, keys: keys, token: token, Fence: fence - int64(chain) + 1, Start: start,
		until: start.Add(validity), released: released, removed: removed, chainLeft: chain - 1, raise: raise}}
}

// acquireSynced runs the acquire script and WAIT on one connection (WAIT
// counts the replicas that have this connection's writes). A grant that too
// few replicas acknowledged is an error: the lock is released by the caller.
func (l *locker) acquireSynced(ctx context.Context, c redis.UniversalClient, keys []string, token string, ttlMs, life int64, chain int) ([]int64, error) {
	cctx, cancel := context.WithTimeout(ctx, 2*l.opts.Timeout)
	defer cancel()
	pipe := c.Pipeline()
	acq := acquireScript.Eval(cctx, pipe, keys, token, ttlMs, l.opts.Permits, l.dom.id, life, l.timeFloor(), chain)
	wait := redis.NewIntCmd(cctx, "wait", l.opts.SyncReplicas, l.opts.Timeout.Milliseconds())
	_ = pipe.Process(cctx, wait)
	_, _ = pipe.Exec(cctx)
	v, err := acq.Int64Slice()
	if err != nil {
		return nil, err
	}
	if v[0] == 1 {
		n, err := wait.Result()
		if err != nil {
			return nil, err
		}
		if n < int64(l.opts.SyncReplicas) {
			return nil, fmt.Errorf("sync_replicas: %d of %d replicas acknowledged the lock", n, l.opts.SyncReplicas)
		}
	}
	return v, nil
}

// timeFloor is "1" in Redlock mode: fencing counters then never fall below
// Redis time in microseconds, so a server restarted empty cannot hand out a
// token that was already used.
func (l *locker) timeFloor() string {
	if len(l.servers) > 1 {
		return "1"
	}
	return "0"
}

// tally counts granted (script returned 1), busy (0) and failed calls.
func tally(res []result) (granted, busy, errs int) {
	for _, r := range res {
		switch {
		case !r.done:
		case r.err != nil:
			errs++
		case r.v.([]int64)[0] == 1:
			granted++
		default:
			busy++
		}
	}
	return
}

// raiseFences raises every key's fencing counter to fence on every server;
// each key needs a majority.
func (l *locker) raiseFences(ctx context.Context, keys []string, fence int64) error {
	for _, k := range keys {
		res := l.callAll(ctx, func(ctx context.Context, c redis.UniversalClient) (any, error) {
			cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
			defer cancel()
			return fenceRaiseScript.Run(cctx, c, []string{fenceKey(k)}, fence).Int64()
		}, l.majorityAnswered, nil)
		ok := 0
		for _, r := range res {
			if r.done && r.err == nil {
				ok++
			}
		}
		if ok < l.quorum {
			return fmt.Errorf("%w: fencing write-back reached %d of %d servers", ErrUnavailable, ok, len(l.servers))
		}
	}
	return nil
}

// releaseKeys releases token on keys on every server, in parallel, with a
// short background context (the request's may be canceled). It returns as
// soon as a majority released each key; a slow or paused server finishes
// in the background (or its lease simply runs out).
//
// With one key and removed not nil, bit i of removed is set when server i
// answers that it removed the token.
func (l *locker) releaseKeys(keys []string, token string, raise int64, removed *atomic.Uint64, wake bool) {
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
	one := func(k string) {
		msg := ""
		if wake {
			msg = l.dom.id + " " + k
		}
		l.callAll(ctx, func(ctx context.Context, c redis.UniversalClient) (any, error) {
			n, err := releaseScript.Run(ctx, c, []string{k, fenceKey(k)}, token, wakeChannel, msg, raise).Int64()
			if err == nil && n == 1 && removed != nil && len(keys) == 1 {
				for i, s := range l.servers {
					if s.client == c {
						removed.Or(1 << i)
					}
				}
			}
			return n, err
		}, l.majorityAnswered, nil)
	}
	if len(keys) == 1 {
		one(keys[0])
	} else {
		var wg sync.WaitGroup
		for _, k := range keys {
			wg.Add(1)
			go func(k string) {
				defer wg.Done()
				one(k)
			}(k)
		}
		wg.Wait()
	}
	if len(l.servers) == 1 {
		cancel()
	} else {
		// Let the stragglers finish within the timeout, then free the context.
		time.AfterFunc(l.opts.Timeout, cancel)
	}
}

// releaseOn releases token on one key of one server (a late grant).
func (l *locker) releaseOn(c redis.UniversalClient, k, token string) {
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
	defer cancel()
	_ = releaseScript.Run(ctx, c, []string{k, fenceKey(k)}, token, wakeChannel, "", 0).Err()
}

// majorityAnswered ends a fan-out once a majority answered without error.
func (l *locker) majorityAnswered(res []result, _ int) bool {
	ok := 0
	for _, r := range res {
		if r.done && r.err == nil {
			ok++
		}
	}
	return ok >= l.quorum
}

// extend renews the lease for another ttl on every server; it counts only
// with a majority within validity.
func (ls *Lease) extend(ctx context.Context) error {
	l := ls.l
	start := time.Now()
	recreate := "0"
	if len(l.servers) > 1 {
		recreate = "1"
	}
	for _, k := range ls.keys {
		results := l.callAll(ctx, func(ctx context.Context, c redis.UniversalClient) (any, error) {
			cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
			defer cancel()
			return extendScript.Run(cctx, c, []string{k}, ls.token, l.opts.TTL.Milliseconds(), l.opts.Permits, recreate).Int64()
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
				ls.mu.Lock()
				expired := time.Now().After(ls.until)
				ls.mu.Unlock()
				if expired {
					return fmt.Errorf("%w: lease ran out while redis was unreachable: %v", ErrLeaseLost, lastErr)
				}
				return fmt.Errorf("%w: extending: %v", ErrUnavailable, lastErr)
			}
			return ErrLeaseLost
		}
	}
	validity := l.opts.TTL - time.Since(start)
	if len(l.servers) > 1 {
		validity -= l.drift()
	}
	if validity <= 0 {
		return fmt.Errorf("%w: extension took longer than the lease", ErrLeaseLost)
	}
	ls.mu.Lock()
	ls.until = start.Add(validity)
	ls.mu.Unlock()
	return nil
}

// keeper keeps one lease alive while its request runs. It is driven by a
// timer, not a goroutine of its own, so a request that ends before the
// first extension costs no goroutine start or join on the hand-off path.
type keeper struct {
	ls       *Lease
	extend   bool          // auto_extend
	maxHold  time.Duration // stop extending after this long (0: never)
	onLost   func(error)
	logPanic func(any)

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
func (ls *Lease) keep(extend bool, maxHold time.Duration, onLost func(error), logPanic func(any)) *keeper {
	k := &keeper{ls: ls, extend: extend, maxHold: maxHold, onLost: onLost, logPanic: logPanic, done: make(chan struct{})}
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
	return k.extend && (k.maxHold <= 0 || time.Since(k.ls.Start) < k.maxHold)
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
		defer func() {
			if r := recover(); r != nil && k.logPanic != nil {
				k.logPanic(r)
			}
		}()
		if !k.extendNow() {
			if k.ls.Valid() <= 0 {
				lost = fmt.Errorf("%w: the lease ran out before the request ended (ttl %s, max_hold %s)", ErrLeaseLost, k.ls.l.opts.TTL, k.maxHold)
			}
			return
		}
		err := k.ls.extend(ctx)
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

// stop ends the keeping and waits for an extension in flight, so no
// extension can follow the release that comes next.
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

// release gives the lease back on every server and wakes the next local
// waiter. It is safe to call more than once.
func (ls *Lease) release() {
	ls.mu.Lock()
	if ls.done {
		ls.mu.Unlock()
		return
	}
	ls.done = true
	ls.mu.Unlock()
	if ls.handOff() {
		// The next holder waits in this P's run-next slot: let it run now
		// rather than after this request's own wind-down.
		runtime.Gosched()
		return
	}
	if ls.released != nil {
		ls.released.Store(true)
	}
	ls.l.releaseKeys(ls.keys, ls.token, ls.raise, ls.removed, true)
	if ls.q != nil {
		ls.q.released()
	}
	ls.l.dom.wakeKeys(ls.keys)
}

// backoff returns the next poll delay with full jitter: uniform in
// [min, min(max, min·2^n)].
func (l *locker) backoff(n int) time.Duration {
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

// Acquire takes the lock on all keys (sorted, deduplicated Redis keys) or
// none, waiting up to opts.Wait. Errors: *BusyError (ErrNotObtained,
// ErrTooManyWaiters), ErrUnavailable, or the context's error.
func (l *locker) Acquire(ctx context.Context, keys []string) (*Lease, error) {
	q := l.dom.queue(keys)
	w, ok := q.enqueue(l.opts.MaxWaiters)
	if !ok {
		l.dom.putQueue(q)
		return nil, &BusyError{Err: ErrTooManyWaiters, RetryAfter: q.retryHint()}
	}
	ls, err := l.wait(ctx, q, w, keys)
	// Leave the queue; a lease handed on just as the wait ended is taken
	// when the caller still wants it, and passed on otherwise.
	if extra := q.leave(w); extra != nil {
		if ls == nil && ctx.Err() == nil {
			ls, err = extra, nil
		} else {
			extra.release()
		}
	}
	if ls != nil {
		ls.q = q
		if !ls.chained {
			q.acquired()
		}
	} else if q.empty() && l.waitqLife(len(keys)) > 0 {
		// Nobody here waits any more: give up this instance's turn in Redis.
		go l.leaveWaitq(keys)
	}
	l.dom.putQueue(q)
	return ls, err
}

// chainSize is how many fencing tokens an acquisition reserves: one per
// holder it may serve by local hand-off (single key, one permit only).
func (l *locker) chainSize(q *keyQueue, keys []string) int {
	if len(keys) != 1 || l.opts.Permits != 1 {
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

// wait runs one waiter's turn: queue, attempts, wake-ups and polls.
func (l *locker) wait(ctx context.Context, q *keyQueue, w *waiter, keys []string) (*Lease, error) {
	var deadline <-chan time.Time
	if l.opts.Wait > 0 {
		t := time.NewTimer(l.opts.Wait)
		defer t.Stop()
		deadline = t.C
	}
	var retryAfter time.Duration
	busyKey, split := 0, false

	// Wait for this waiter's turn: first come, first served.
	if !w.head() {
		if l.opts.Wait <= 0 {
			return nil, &BusyError{Err: ErrNotObtained, RetryAfter: q.retryHint()}
		}
		select {
		case <-w.turn:
		case g := <-w.grant:
			return g, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-deadline:
			return nil, &BusyError{Err: ErrNotObtained, RetryAfter: q.retryHint()}
		}
	}

	subscribed := false
	for n := 0; ; n++ {
		// Skip a useless attempt while this instance itself holds every permit.
		if n > 0 || !q.heldLocally(l.opts.Permits) {
			a := l.tryAcquire(ctx, keys, l.chainSize(q, keys), busyKey)
			if a.err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				return nil, a.err
			}
			if a.lease != nil {
				return a.lease, nil
			}
			retryAfter, busyKey, split = a.retryAfter, a.busyKey, a.split
			q.setRetryHint(retryAfter)
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if l.opts.Wait <= 0 {
				return nil, &BusyError{Err: ErrNotObtained, RetryAfter: retryAfter}
			}
			if !subscribed {
				// Subscribe, then try once more: a release between the failed
				// attempt and the subscription would otherwise go unnoticed.
				subscribed = true
				if l.subscribe(ctx) {
					continue
				}
			}
		} else if l.opts.Wait <= 0 {
			return nil, &BusyError{Err: ErrNotObtained, RetryAfter: q.retryHint()}
		}
		d := l.backoff(n)
		if retryAfter > 0 && retryAfter < d {
			d = retryAfter + time.Millisecond
		}
		t := time.NewTimer(d)
		wake := w.wake
		if split {
			wake = nil
		}
		select {
		case g := <-w.grant:
			t.Stop()
			return g, nil
		case <-wake:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-deadline:
			t.Stop()
			return nil, &BusyError{Err: ErrNotObtained, RetryAfter: retryAfter}
		}
		t.Stop()
	}
}

// subscribe makes sure every server's wake-up listener runs, and reports
// whether a subscription became active just now (so the caller tries again).
func (l *locker) subscribe(ctx context.Context) bool {
	fresh := false
	for _, s := range l.servers {
		if s.wake.ensure(ctx, l.opts.Timeout) {
			fresh = true
		}
	}
	return fresh
}

// leaveWaitq removes this instance from the keys' Redis wait lists.
func (l *locker) leaveWaitq(keys []string) {
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
	defer cancel()
	for _, k := range keys {
		for _, s := range l.servers {
			s.client.ZRem(ctx, waitqKey(k), l.dom.id)
		}
	}
}

// ---- local queues -------------------------------------------------------

// domain groups the local queues of lockers that share the same Redis
// servers, across handlers and config reloads, so waiters of one key in one
// Caddy instance form one queue.
type domain struct {
	key  string
	id   string // this instance's id in Redis wait lists and wake messages
	refs int

	mu     sync.Mutex
	queues map[string]*keyQueue // by joined key set
	byKey  map[string]map[*keyQueue]struct{}
}

var (
	domainsMu sync.Mutex
	domains   = map[string]*domain{}
)

func acquireDomain(key string) *domain {
	domainsMu.Lock()
	defer domainsMu.Unlock()
	d := domains[key]
	if d == nil {
		d = &domain{key: key, id: uuid.NewString(), queues: map[string]*keyQueue{}, byKey: map[string]map[*keyQueue]struct{}{}}
		domains[key] = d
	}
	d.refs++
	return d
}

func releaseDomain(d *domain) {
	domainsMu.Lock()
	defer domainsMu.Unlock()
	d.refs--
	if d.refs == 0 {
		delete(domains, d.key)
	}
}

// queue returns the queue of a key set, creating it; pair with putQueue.
func (d *domain) queue(keys []string) *keyQueue {
	id := strings.Join(keys, "\x00")
	d.mu.Lock()
	defer d.mu.Unlock()
	q := d.queues[id]
	if q == nil {
		q = &keyQueue{id: id, keys: keys}
		d.queues[id] = q
		for _, k := range keys {
			m := d.byKey[k]
			if m == nil {
				m = map[*keyQueue]struct{}{}
				d.byKey[k] = m
			}
			m[q] = struct{}{}
		}
	}
	q.refs++
	return q
}

// putQueue drops a reference; an unused queue is forgotten.
func (d *domain) putQueue(q *keyQueue) {
	d.mu.Lock()
	defer d.mu.Unlock()
	q.refs--
	if q.refs == 0 {
		delete(d.queues, q.id)
		for _, k := range q.keys {
			delete(d.byKey[k], q)
			if len(d.byKey[k]) == 0 {
				delete(d.byKey, k)
			}
		}
	}
}

// wakeKeys wakes the head waiter of every local queue that involves one of
// keys (a release here or, via Pub/Sub, elsewhere).
func (d *domain) wakeKeys(keys []string) {
	d.mu.Lock()
	var qs []*keyQueue
	for _, k := range keys {
		for q := range d.byKey[k] {
			qs = append(qs, q)
		}
	}
	d.mu.Unlock()
	for _, q := range qs {
		q.wakeHead()
	}
}

// keyQueue is the FIFO of this instance's waiters for one key set. Only
// the head asks Redis; the others wait for their turn.
type keyQueue struct {
	id   string
	keys []string
	refs int // guarded by domain.mu

	mu      sync.Mutex
	waiters []*waiter
	held    int           // leases of this key set held in this instance
	hint    time.Duration // last known time until the holder's lease ends
}

type waiter struct {
	q     *keyQueue
	turn  chan struct{} // closed when this waiter becomes head
	wake  chan struct{} // buffered: a release happened
	grant chan *Lease   // buffered: a lease handed on by the previous holder
}

func (w *waiter) head() bool {
	select {
	case <-w.turn:
		return true
	default:
		return false
	}
}

// enqueue appends a waiter; false when maxWaiters (>0) are already waiting.
func (q *keyQueue) enqueue(maxWaiters int) (*waiter, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if maxWaiters > 0 && len(q.waiters) >= maxWaiters {
		return nil, false
	}
	w := &waiter{q: q, turn: make(chan struct{}), wake: make(chan struct{}, 1), grant: make(chan *Lease, 1)}
	q.waiters = append(q.waiters, w)
	if len(q.waiters) == 1 {
		close(w.turn)
	}
	return w, true
}

// leave removes w; if it was the head, the next waiter's turn begins. It
// returns a lease handed to w that w has not taken yet.
func (q *keyQueue) leave(w *waiter) *Lease {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, x := range q.waiters {
		if x == w {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			if i == 0 && len(q.waiters) > 0 {
				close(q.waiters[0].turn)
			}
			break
		}
	}
	select {
	case g := <-w.grant:
		return g
	default:
		return nil
	}
}

// waiting counts the waiters queued here.
func (q *keyQueue) waiting() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters)
}

func (q *keyQueue) empty() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters) == 0
}

func (q *keyQueue) acquired() {
	q.mu.Lock()
	q.held++
	q.mu.Unlock()
}

func (q *keyQueue) released() {
	q.mu.Lock()
	if q.held > 0 {
		q.held--
	}
	q.mu.Unlock()
}

func (q *keyQueue) heldLocally(permits int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.held >= permits
}

func (q *keyQueue) wakeHead() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) > 0 {
		select {
		case q.waiters[0].wake <- struct{}{}:
		default:
		}
	}
}

func (q *keyQueue) setRetryHint(d time.Duration) {
	q.mu.Lock()
	q.hint = d
	q.mu.Unlock()
}

// retryHint is the last known time until the holder's lease ends.
func (q *keyQueue) retryHint() time.Duration {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.hint
}

// ---- Pub/Sub wake-ups ---------------------------------------------------

// dispatchWake delivers a release announced on Redis to the local queues of
// that key in every domain but the one that announced it (which woke its own
// queue already). Two domains in one process share a Redis server when they
// use different client settings for it.
func dispatchWake(payload string) {
	from, key, ok := strings.Cut(payload, " ")
	if !ok {
		return
	}
	domainsMu.Lock()
	var ds []*domain
	for _, d := range domains {
		if d.id != from {
			ds = append(ds, d)
		}
	}
	domainsMu.Unlock()
	for _, d := range ds {
		d.wakeKeys([]string{key})
	}
}

// wakeListener holds the one Pub/Sub subscription of one Redis client. It
// starts on the first contended wait, reconnects by itself, and stops with
// the pooled client.
type wakeListener struct {
	client redis.UniversalClient

	mu      sync.Mutex
	started bool
	active  bool          // subscription confirmed
	ready   chan struct{} // closed when active
	cancel  context.CancelFunc
	done    chan struct{}
	ps      *redis.PubSub
}

func newWakeListener(c redis.UniversalClient) *wakeListener {
	return &wakeListener{client: c, ready: make(chan struct{})}
}

// ensure starts the listener on first use and waits (up to timeout) for
// its subscription. It returns true when the subscription became active
// during the call, so the caller should try once more (a release between
// its failed attempt and the subscription would otherwise go unnoticed).
func (wl *wakeListener) ensure(ctx context.Context, timeout time.Duration) bool {
	wl.mu.Lock()
	if wl.active {
		wl.mu.Unlock()
		return false
	}
	if wl.started {
		// Reconnecting after a fault: don't hold the waiter up; its backoff
		// poll covers the gap, and the next contended wait re-checks.
		wl.mu.Unlock()
		return false
	}
	wl.started = true
	lctx, cancel := context.WithCancel(context.Background())
	wl.cancel = cancel
	wl.done = make(chan struct{})
	go wl.run(lctx)
	ready := wl.ready
	wl.mu.Unlock()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-ready:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

func (wl *wakeListener) setActive(on bool) {
	wl.mu.Lock()
	defer wl.mu.Unlock()
	if on && !wl.active {
		wl.active = true
		close(wl.ready)
	} else if !on && wl.active {
		wl.active = false
		wl.ready = make(chan struct{})
	}
}

func (wl *wakeListener) run(ctx context.Context) {
	defer close(wl.done)
	defer func() {
		if r := recover(); r != nil {
			// A listener must never take Caddy down; waiters fall back to polling.
			wl.setActive(false)
		}
	}()
	ps := wl.client.Subscribe(ctx, wakeChannel)
	defer ps.Close()
	wl.mu.Lock()
	wl.ps = ps
	wl.mu.Unlock()
	fails := 0
	for ctx.Err() == nil {
		msg, err := ps.ReceiveTimeout(ctx, 30*time.Second)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			var ne interface{ Timeout() bool }
			if errors.As(err, &ne) && ne.Timeout() {
				// Quiet channel: check the connection is alive.
				if perr := ps.Ping(ctx); perr == nil {
					continue
				}
			}
			wl.setActive(false)
			fails++
			d := time.Duration(fails) * 100 * time.Millisecond
			if d > time.Second {
				d = time.Second
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(d):
			}
			continue
		}
		fails = 0
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				wl.setActive(true)
			}
		case *redis.Message:
			dispatchWake(m.Payload)
		}
	}
}

func (wl *wakeListener) stop() {
	wl.mu.Lock()
	cancel, done, ps := wl.cancel, wl.done, wl.ps
	wl.mu.Unlock()
	if cancel != nil {
		cancel()
		if ps != nil {
			_ = ps.Close() // interrupts a blocked read
		}
		<-done
	}
}

// sortKeys deduplicates and sorts keys.
func sortKeys(keys []string) []string {
	sort.Strings(keys)
	out := keys[:0]
	for i, k := range keys {
		if i == 0 || k != keys[i-1] {
			out = append(out, k)
		}
	}
	return out
}

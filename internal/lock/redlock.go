package lock

// The lock engine: one Redis server or a Redlock quorum of 3, 5 or 7,
// acquire (waiting in the local queue, woken on release, polling with
// backoff as the fallback), extend and release, with fencing tokens.
//
// It knows nothing of HTTP or Caddy (a test keeps it so): the handler gives
// it sorted Redis keys and gets a *Lease back. attempt.go holds one attempt
// on every key and server, lease.go what a held lease does (hand-off,
// renewal, the keeper), queue.go the per-key local queues, wake.go the
// Pub/Sub listener.

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

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

	AcquireScript    = redisconn.NewScript(acquireLua)
	ExtendScript     = redisconn.NewScript(extendLua)
	ReleaseScript    = redisconn.NewScript(releaseLua)
	fenceRaiseScript = redisconn.NewScript(fenceRaiseLua)
	renewScript      = redisconn.NewScript(renewLua)
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

// BusyError is returned (wrapping ErrNotObtained or ErrTooManyWaiters) when
// the lock could not be taken in time. leaseLeft is the time until the
// holder's lease ends (0 when unknown), ahead the requests of this instance
// that queued before this one: the handler estimates Retry-After from them.
type BusyError struct {
	err       error
	leaseLeft time.Duration
	ahead     int
}

func (e *BusyError) Error() string { return e.err.Error() }
func (e *BusyError) Unwrap() error { return e.err }

// Options configures a locker.
type Options struct {
	TTL        time.Duration
	Wait       time.Duration
	BackoffMin time.Duration
	BackoffMax time.Duration
	Permits    int
	MaxWaiters int
	Timeout    time.Duration // bound of one Redis call
	// SyncReplicas > 0: WAIT for that many replicas before a lock counts.
	SyncReplicas int
	// Replay > 0: an acquisition answers with a holder's stored answer
	// (kept this long) when there is one (one server, one key).
	Replay time.Duration
	// Handler names the handler in the log lines of the releases it
	// leaves to a server's background releaser, and to OnReleaseFailure.
	Handler string
}

// Replayed is what Acquire returns when an earlier holder's answer is
// stored for the key: the request is answered with it, no lock is taken.
type Replayed struct{ answer string }

func (r *Replayed) Error() string { return "redisdlm: answered from a stored response" }

// Locker takes locks on one Redis server or a Redlock quorum of servers.
type Locker struct {
	servers []*Server
	quorum  int
	opts    Options
	dom     *domain
	logger  *slog.Logger
}

// New builds a locker over servers (1, 3, 5 or 7). It does not dial.
//
// Lockers share a domain (one local queue per key) when they use the same
// servers and the options a hand-off passes on (ttl, permits,
// sync_replicas): a lease is only ever handed to a waiter that would have
// taken the same lease itself.
func New(servers []*Server, opts Options, logger *slog.Logger) *Locker {
	ids := make([]string, len(servers))
	for i, s := range servers {
		ids[i] = s.id
	}
	domKey := fmt.Sprintf("%s|ttl=%d|permits=%d|sync=%d", strings.Join(ids, ","), opts.TTL, opts.Permits, opts.SyncReplicas)
	return &Locker{
		servers: servers,
		quorum:  len(servers)/2 + 1,
		opts:    opts,
		dom:     acquireDomain(domKey),
		logger:  logger,
	}
}

// close drops this locker's reference to its shared queue domain.
func (l *Locker) close() { releaseDomain(l.dom) }

// Acquire takes the lock on all keys (sorted, deduplicated Redis keys) or
// none, waiting up to opts.Wait. Errors: *BusyError (ErrNotObtained,
// ErrTooManyWaiters), ErrUnavailable, or the context's error.
//
// The returned lease holds a reference to the key's local queue until it
// is released, so waiters that arrive while it is held queue behind it.
func (l *Locker) Acquire(ctx context.Context, keys []string) (*Lease, error) {
	q := l.dom.queue(keys)
	w, ok := q.enqueue(l.opts.MaxWaiters)
	if !ok {
		l.dom.putQueue(q)
		return nil, &BusyError{err: ErrTooManyWaiters, leaseLeft: q.retryHint(), ahead: q.waiting()}
	}
	l.useServers()
	ls, err := l.wait(ctx, q, w, keys)
	var busy *BusyError
	if errors.As(err, &busy) {
		busy.ahead = q.position(w)
	}
	// Leave the queue; a lease handed on just as the wait ended is taken
	// when the caller still wants it, and passed on otherwise.
	if extra := q.leave(w); extra != nil {
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
	q.setRetryHint(ls.Valid())
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
func (l *Locker) wait(ctx context.Context, q *keyQueue, w *waiter, keys []string) (*Lease, error) {
	var deadline <-chan time.Time
	if l.opts.Wait > 0 {
		t := time.NewTimer(l.opts.Wait)
		defer t.Stop()
		deadline = t.C
	}
	var retryAfter, took time.Duration
	busyKey, split := 0, false

	// Wait for this waiter's turn: first come, first served.
	if !w.head() {
		if l.opts.Wait <= 0 {
			return nil, &BusyError{err: ErrNotObtained, leaseLeft: q.retryHint()}
		}
		select {
		case <-w.turn:
		case g := <-w.grant:
			return g, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-deadline:
			return nil, &BusyError{err: ErrNotObtained, leaseLeft: q.retryHint()}
		}
	}

	// A lease of these keys that this instance gave back a moment ago may
	// still be on its way to Redis (it is released in the background, after
	// the answer): wait for that first, so this request does not find the
	// lock held by the request before it.
	if done := q.releaseDone(); done != nil {
		t := time.NewTimer(l.opts.Timeout)
		select {
		case <-done:
			// That release also woke this waiter; the attempt below
			// follows it, so the wake-up is spent.
			select {
			case <-w.wake:
			default:
			}
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		t.Stop()
	}

	subscribed := false
	for n := 0; ; n++ {
		// While this instance itself holds every permit, its holder hands
		// the lease on or wakes this waiter: skip the first attempt, and
		// poll only as the safety net (a holder that lost its lease).
		local := q.heldLocally(l.opts.Permits)
		if n > 0 || !local {
			began := time.Now()
			a := l.tryAcquire(ctx, keys, l.chainSize(q, keys), busyKey)
			took = time.Since(began)
			if a.err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				return nil, a.err
			}
			if a.lease != nil {
				return a.lease, nil
			}
			if a.answer != "" {
				return nil, &Replayed{answer: a.answer}
			}
			retryAfter, busyKey, split = a.retryAfter, a.busyKey, a.split
			q.setRetryHint(retryAfter)
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if l.opts.Wait <= 0 {
				return nil, &BusyError{err: ErrNotObtained, leaseLeft: retryAfter}
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
			return nil, &BusyError{err: ErrNotObtained, leaseLeft: q.retryHint()}
		}
		d := l.backoff(n)
		if local {
			d = l.opts.BackoffMax // only the safety net
		} else if retryAfter > 0 && retryAfter < d {
			d = retryAfter + time.Millisecond
		}
		t := time.NewTimer(d)
		wake := w.wake
		for waiting := true; waiting; {
			select {
			case g := <-w.grant:
				t.Stop()
				return g, nil
			case <-wake:
				if !split {
					waiting = false
					break
				}
				// The last attempt took part of what it needed: it met a
				// release half done, or a rival that took part too. Retry
				// after a random delay of about one attempt, so the release
				// is complete and two rivals woken by the same message do
				// not collide in step again.
				wake = nil
				t.Reset(rand.N(2*took + time.Millisecond))
			case <-t.C:
				waiting = false
			case <-ctx.Done():
				t.Stop()
				return nil, ctx.Err()
			case <-deadline:
				t.Stop()
				return nil, &BusyError{err: ErrNotObtained, leaseLeft: retryAfter}
			}
		}
		t.Stop()
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

func (l *Locker) turnsFlag(keys int) string {
	if l.turns(keys) {
		return "1"
	}
	return "0"
}

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
			if e := s.client.ZRem(cctx, WaitqKey(k), l.dom.id).Err(); e != nil {
				err = e
			}
		}
		return nil, err
	}, nil, nil)
}

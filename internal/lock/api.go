package lock

// What the handler and its admin API read and call of the engine, besides
// Acquire.

import (
	"context"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// Close releases the locker's share of its queue domain.
func (l *Locker) Close() { l.close() }

// Clients returns the clients of the locker's servers, in config order.
func (l *Locker) Clients() []redis.UniversalClient {
	out := make([]redis.UniversalClient, len(l.servers))
	for i, s := range l.servers {
		out[i] = s.conn.Client
	}
	return out
}

// InstanceID is this instance's id in the lock's Redis wait lists.
func (l *Locker) InstanceID() string { return l.dom.id }

// Local counts this instance's waiters and holders of a Redis lock key,
// over every local queue that involves it (a key set holding it).
func (l *Locker) Local(redisKey string) (waiters, held int) {
	d := l.dom
	d.mu.Lock()
	w := WakeID(redisKey)
	qs := slices.Clone(d.byWake[w])
	d.mu.Unlock()
	for _, q := range qs {
		q.mu.Lock()
		waiters += len(q.waiters)
		held += q.held
		q.mu.Unlock()
	}
	return waiters, held
}

// Extend extends ls once on every server, as its keeper does every ttl/3:
// ErrLeaseLost when a majority no longer holds it for ls or its validity
// ended, ErrUnavailable when too few servers answered.
func (l *Locker) Extend(ctx context.Context, ls *Lease) error { return l.extend(ctx, ls) }

// WakeLocal wakes this instance's waiters of a Redis lock key.
func (l *Locker) WakeLocal(redisKey string) { l.dom.wakeKeys([]string{redisKey}) }

// Inspect reads a Redis lock key's state on every server, in server order
// (see ServerState); it changes nothing. Holder tokens are never part of it.
func (l *Locker) Inspect(ctx context.Context, redisKey string) []ServerState {
	return l.inspect(ctx, redisKey)
}

// ForceRelease removes every holder of a Redis lock key on every server
// and wakes its waiters in every instance; with lock_delay nobody gets the
// key for the delay. An old holder's next extension finds its lease lost.
// Per server, in server order: the live holders removed, or its error.
func (l *Locker) ForceRelease(ctx context.Context, redisKey string) []Removal {
	return l.forceRelease(ctx, redisKey)
}

// ClearReplay deletes a Redis lock key's run record or stored answer on
// every server: a key left in doubt may be run again, a stored answer is
// no longer replayed. Per server, in server order: the keys deleted (0 or
// 1), or its error.
func (l *Locker) ClearReplay(ctx context.Context, redisKey string) []Removal {
	return l.clearReplay(ctx, redisKey)
}

// Fence is the lease's fencing token.
func (ls *Lease) Fence() int64 { return ls.fence }

// Granted is when the lease was granted.
func (ls *Lease) Granted() time.Time { return ls.start }

// ReleaseInBackground releases the lease (see release), storing answer for
// replay when it is not "", with the Redis round trip after it returns: a
// response is not held up by it.
func (ls *Lease) ReleaseInBackground(answer string) { ls.releaseWith(answer, releaseInBackground) }

// HandOffNow begins a release that its caller sends later: it passes the
// lease to a waiter of this instance at once, as a release would, and
// reports whether it did (the lease is then done, with nothing to release
// in Redis). Otherwise it announces the release (a request of this instance
// for the keys waits for it before its first attempt, as for any release
// on its way), and the caller's next release call (ReleaseInBackground)
// sends it. A holder that puts its release off until its response is
// written still hands the lease on without delay. The holder calls it and
// that release one after the other, as any release.
func (ls *Lease) HandOffNow() bool { return ls.handOffNow() }

// Abandon releases the lease in the background as a holder that did not
// finish cleanly (its client went away while the route still ran, so its
// upstream may still be writing): with lock_delay, nobody is granted the
// keys for the delay, and the lease is not handed on.
func (ls *Lease) Abandon() {
	ls.unclean.Store(true)
	ls.releaseWith("", releaseInBackground)
}

// Keep starts keeping the lease: with o.Extend, it is extended every ttl/3
// (owner-checked) until Stop or o.MaxHold; a lease that is not extended
// (any more) is reported lost when its validity ends.
func (ls *Lease) Keep(o KeepOptions) Keeper {
	return Keeper{newKeeper(ls, o)}
}

// ClearRun says that the lease's run did not happen or failed (the route
// wrote a 5xx or a transient 408, 409, 425 or 429, or never reached its
// upstream): its release deletes the run record, so a duplicate may run.
// Without it the record stays for the replay window, refusing duplicates
// as in doubt, unless an answer is stored over it.
func (ls *Lease) ClearRun() { ls.clearRun.Store(true) }

// KeepAnswer stores answer for replay before the lease is released, for a
// holder whose own clock says its lease ended: it is stored only while the
// token still holds the lock, or over the lease's own run record (nobody
// else ran since). It reports whether it was stored. The lease is released
// afterwards, as any (without the answer).
func (ls *Lease) KeepAnswer(ctx context.Context, answer string) (bool, error) {
	l := ls.l
	ctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
	defer cancel()
	n, err := keepAnswerScript.Run(ctx, l.servers[0].client, []string{ls.keys[0], ReplayKey(ls.keys[0])},
		ls.token, answer, l.opts.Replay.Milliseconds()).Int64()
	return n == 1, err
}

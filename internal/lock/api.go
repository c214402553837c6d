package lock

// What the handler (package redisdlm) and its admin API read and call of
// the engine, besides Acquire.

import (
	"time"

	"github.com/redis/go-redis/v9"
)

// Close releases the locker's share of its queue domain.
func (l *Locker) Close() { l.close() }

// Clients returns the clients of the locker's servers, in config order.
func (l *Locker) Clients() []redis.UniversalClient {
	out := make([]redis.UniversalClient, len(l.servers))
	for i, s := range l.servers {
		out[i] = s.client
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
	qs := make([]*keyQueue, 0, len(d.byWake[w]))
	for q := range d.byWake[w] {
		qs = append(qs, q)
	}
	d.mu.Unlock()
	for _, q := range qs {
		q.mu.Lock()
		waiters += len(q.waiters)
		held += q.held
		q.mu.Unlock()
	}
	return waiters, held
}

// WakeLocal wakes this instance's waiters of a Redis lock key.
func (l *Locker) WakeLocal(redisKey string) { l.dom.wakeKeys([]string{redisKey}) }

// Fence is the lease's fencing token.
func (ls *Lease) Fence() int64 { return ls.fence }

// Granted is when the lease was granted.
func (ls *Lease) Granted() time.Time { return ls.start }

// ReleaseInBackground releases the lease (see release), storing answer for
// replay when it is not "", with the Redis round trip after it returns: a
// response is not held up by it.
func (ls *Lease) ReleaseInBackground(answer string) { ls.releaseWith(answer, true) }

// KeepOptions say how a held lease is kept (see Keep).
type KeepOptions struct {
	Extend  bool          // extend it every ttl/3 (owner-checked)
	MaxHold time.Duration // stop extending this long after the grant (0: never)
	OnLost  func(error)   // runs at most once, when the lease is lost
}

// Keeper keeps a lease alive until Stop.
type Keeper struct{ k *keeper }

// Keep starts keeping the lease: with o.Extend, it is extended every ttl/3
// (owner-checked) until Stop or o.MaxHold; a lease that is not extended
// (any more) is reported lost when its validity ends.
func (ls *Lease) Keep(o KeepOptions) Keeper {
	return Keeper{ls.keep(o.Extend, o.MaxHold, o.OnLost)}
}

// Stop stops keeping the lease; no extension follows it.
func (k Keeper) Stop() { k.k.stop() }

// LeaseLeft is the time until the holder's lease ends (0 when unknown).
func (e *BusyError) LeaseLeft() time.Duration { return e.leaseLeft }

// Ahead is the requests of this instance that queued before this one.
func (e *BusyError) Ahead() int { return e.ahead }

// Answer is the earlier holder's stored answer.
func (r *Replayed) Answer() string { return r.answer }

// CloseWhenIdle stops the wake-up listener and runs closeClient once no
// user of the client is left (at once when none is).
func (s *Server) CloseWhenIdle(closeClient func()) { s.closeWhenIdle(closeClient) }

// OnReleaseFailure sets what counts a failed release of a lease that was
// held, or whose acquire outcome is unknown (before the server is used);
// it is told the lease's handler (Options.Handler).
func (s *Server) OnReleaseFailure(count func(handler string)) { s.onReleaseFailure = count }

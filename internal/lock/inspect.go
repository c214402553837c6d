package lock

// Read-outs and settings of the engine's state for the tests of the
// handler (package redisdlm), which watch the engine under real Redis
// servers and Caddy configs.

import (
	"context"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
)

// ReleaseGiveUpExtra: a release is retried for 2 × ttl plus this long.
const ReleaseGiveUpExtra = releaseGiveUpExtra

// Servers are the locker's servers, in config order.
func (l *Locker) Servers() []*Server { return l.servers }

// SetLogger replaces the locker's logger.
func (l *Locker) SetLogger(lg *slog.Logger) { l.logger = lg }

// SharesQueues reports whether l and o queue their waiters together (one
// domain: the same servers, ttl, permits and sync_replicas).
func (l *Locker) SharesQueues(o *Locker) bool { return l.dom == o.dom }

// Queues is the number of local key queues of the locker's domain.
func (l *Locker) Queues() int {
	l.dom.mu.Lock()
	defer l.dom.mu.Unlock()
	return len(l.dom.queues)
}

// WaitersFor counts the local waiters queued for one Redis key.
func (l *Locker) WaitersFor(redisKey string) int {
	d := l.dom
	d.mu.Lock()
	q := d.queues[redisKey]
	d.mu.Unlock()
	if q == nil {
		return 0
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters)
}

// Extend extends ls once on every server (see extend).
func (l *Locker) Extend(ctx context.Context, ls *Lease) error { return l.extend(ctx, ls) }

// Token is the lease's owner token in Redis.
func (ls *Lease) Token() string { return ls.token }

// QueueWaiting is the waiters of the lease's local queue.
func (ls *Lease) QueueWaiting() int { return ls.q.waiting() }

// HeldLocally reports whether the lease's local queue knows n holders here.
func (ls *Lease) HeldLocally(n int) bool { return ls.q.heldLocally(n) }

// Client is the server's Redis client.
func (s *Server) Client() redis.UniversalClient { return s.conn.Client }

// SetLogger replaces the server's logger.
func (s *Server) SetLogger(lg func() *slog.Logger) { s.logger = lg }

// QueuedCalls is how many acquires and releases wait in the server's pipe
// for a pipeline (for tests).
func (s *Server) QueuedCalls() int { return s.pipe.Queued() }

// PendingReleases is how many releases the server still owes.
func (s *Server) PendingReleases() int { return s.rel.pendingCount() }

// NewBusyError is the error of a lock not taken in time (wrapping err),
// with the holder's lease left, how long it has held the lock (<0:
// unknown), the requests ahead here and the other instances waiting
// (handler tests).
func NewBusyError(err error, leaseLeft, held time.Duration, ahead, others int) *BusyError {
	return &BusyError{err: err, facts: busyFacts{at: time.Now(), leaseLeft: leaseLeft, held: held, others: others}, ahead: ahead}
}

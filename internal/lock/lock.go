// Package lock is the lock engine under redis_lock, on one Redis server
// (or Cluster, or Sentinel group) or a Redlock quorum of independent
// servers: Acquire fans an attempt out to every server and decides by
// majority, waits in a local FIFO queue per key set (woken through Pub/Sub
// when a holder elsewhere releases), and returns a Lease that renews its
// fencing tokens, is extended while kept, and is released (handed to the
// next local waiter, or released on every server, retried in the
// background when an answer is lost).
//
// It knows nothing of Caddy or HTTP: the handler (package redislock)
// renders the keys, logs through the *slog.Logger it hands in, and counts
// failed releases through Server.OnReleaseFailure. It calls Redis through
// the smallest client interface it needs (Client) and reads the time of
// its validities and schedules from a Clock, so its tests wrap a real
// client to inject faults and move time without sleeping.
//
// This file is its whole face: every exported function, method, constant
// and variable, and every exported type but the opaque ones (Locker,
// Lease, Server: their fields are unexported, declared with their work),
// is here; the work behind them is in the files of each concern, listed
// in docs/design.md.
package lock

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

// A locker and its options.

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
	// LockDelay > 0: after a lease ends without its holder's clean
	// release (it expired, was force-released or lost, or was abandoned),
	// nobody is granted the keys for this long.
	LockDelay time.Duration
	// Clock is read for validities and the keeper's schedule (nil: the
	// real one).
	Clock Clock
}

// New builds a locker over servers (1, 3, 5 or 7). It does not dial.
//
// Lockers share a domain (one local queue per key) when they use the same
// servers and the options a hand-off passes on (ttl, permits,
// sync_replicas, lock_delay) and both replay or neither does: a lease is
// only ever handed to a waiter that would have taken the same lease itself
// (a replay waiter asks Redis for a stored answer first, which a lease
// handed on by a locker without replay would pass by).
func New(servers []*Server, opts Options, logger *slog.Logger) *Locker {
	return newLocker(servers, opts, logger)
}

// Run names a request that must run at most once per key within the
// replay window (replay, an unsafe method): its grant writes a run record
// under the key, with Fingerprint, that refuses every other request until
// an answer is stored or the run is cleared (see Lease.ClearRun).
type Run struct {
	Fingerprint string
}

// Acquire takes the lock on all keys (sorted, deduplicated Redis keys) or
// none, waiting up to opts.Wait. Errors: *BusyError (ErrNotObtained,
// ErrTooManyWaiters), ErrUnavailable, or the context's error; with
// replay also *Replayed.
//
// The returned lease holds a reference to the key's local queue until it
// is released, so waiters that arrive while it is held queue behind it.
func (l *Locker) Acquire(ctx context.Context, keys []string) (*Lease, error) {
	return l.acquire(ctx, keys, nil)
}

// AcquireRun is Acquire for a Run (one key; replay on): besides Acquire's
// errors, *InDoubtError when another request's run of the key started and
// its outcome is unknown, and ErrRunMismatch when it was another request's
// (fingerprint).
func (l *Locker) AcquireRun(ctx context.Context, keys []string, run Run) (*Lease, error) {
	return l.acquire(ctx, keys, &run)
}

// What the handler and its admin API read and call of a locker, besides
// Acquire.

// Close releases the locker's share of its queue domain.
func (l *Locker) Close() { l.close() }

// Local counts this instance's waiters and holders of a Redis lock key,
// over every local queue that involves it (a key set holding it).
func (l *Locker) Local(redisKey string) (waiters, held int) { return l.dom.local(redisKey) }

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

// A held lease.

// Release gives the lease back on every server and wakes the next local
// waiter — or hands it on to that waiter without a Redis call. It is safe
// to call more than once.
func (ls *Lease) Release() { ls.releaseWith("", releaseNow) }

// Valid reports the remaining validity of the lease.
func (ls *Lease) Valid() time.Duration { return ls.valid() }

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
func (ls *Lease) Abandon() { ls.abandon() }

// Keep starts keeping the lease: with o.Extend, it is extended every ttl/3
// (owner-checked) until Stop or o.MaxHold; a lease that is not extended
// (any more) is reported lost when its validity ends.
func (ls *Lease) Keep(o KeepOptions) Keeper { return Keeper{newKeeper(ls, o)} }

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
	return ls.keepAnswer(ctx, answer)
}

// KeepOptions say how a held lease is kept (see Keep).
type KeepOptions struct {
	Extend  bool          // extend it every ttl/3 (owner-checked)
	MaxHold time.Duration // stop extending this long after the grant (0: never)
	OnLost  func(error)   // runs at most once, when the lease is lost
}

// Keeper keeps a lease alive until Stop.
type Keeper struct{ k *keeper }

// Stop stops keeping the lease; no extension follows it.
func (k Keeper) Stop() { k.k.stop() }

// The Redis servers.

// Client is what the engine calls on a server's Redis client, and no more:
// its scripts and commands (Process, through redisconn.Script, which sends
// EVALSHA, then EVAL on NOSCRIPT, and never resends a call whose answer
// was lost), and a pipeline for an acquire followed by WAIT
// (sync_replicas). A *redis.Client or *redis.ClusterClient is one; a test
// wraps one to inject what a real Redis cannot, such as an answer lost
// after the write. (The wake-up listener subscribes on the shared client
// itself.)
type Client interface {
	redisconn.Processor
	Pipeline() redis.Pipeliner
}

// NewServer wraps a shared client; nothing is dialed until the first call.
// logger returns the logger of the moment (the server outlives configs).
func NewServer(id string, conn *redisconn.Conn, logger func() *slog.Logger) *Server {
	return newServer(id, conn, logger)
}

// CloseWhenIdle stops the wake-up listener and runs closeClient once no
// user of the client is left (at once when none is).
func (s *Server) CloseWhenIdle(closeClient func()) { s.closeWhenIdle(closeClient) }

// OnReleaseFailure sets what counts a failed release of a lease that was
// held, or whose acquire outcome is unknown (before the server is used).
func (s *Server) OnReleaseFailure(count func(handler string)) { s.onReleaseFailure = count }

// Keys, the wake-up channel and what an operator sees of a key.

// FenceKey is the fencing counter of a lock key; WaitqKey the list of
// instances waiting for it. Both share the lock key's hash tag.
func FenceKey(lockKey string) string  { return lockKey + fenceSuffix }
func ReplayKey(lockKey string) string { return lockKey + replaySuffix }
func WaitqKey(lockKey string) string  { return lockKey + waitqSuffix }

// DeadKey holds the tokens of attempts given up while their outcome was
// unknown: the acquire script never grants them (see lock_acquire.lua).
func DeadKey(lockKey string) string { return lockKey + deadSuffix }

// DelayKey holds the lock_delay ends of a lock key: after a lease ends
// without its holder's release, nobody is granted it until then (see
// lock_acquire.lua).
func DelayKey(lockKey string) string { return lockKey + delaySuffix }

// WakeID is how a wake-up names a lock key on the Pub/Sub channel: an
// opaque digest, so a client of a shared Redis that subscribes learns
// nothing of the keys (user ids, paths) being locked.
func WakeID(lockKey string) string {
	var buf [32]byte
	return string(appendWakeID(buf[:0], lockKey))
}

// WakeChannel is the one Pub/Sub channel per Redis server on which releases
// are announced; the message is "<domain id> <WakeID of the lock key>".
const WakeChannel = "redisdlm:wake"

// ServerState is one server's state of a lock key (Inspect).
type ServerState struct {
	// Err: the server could not be read; the other fields are zero.
	Err error
	// LeaseLeft is the time left on each live holder's lease (ms precision).
	LeaseLeft []time.Duration
	// Fence is the key's fencing counter (nil: the key has none).
	Fence *int64
	// InstancesWaiting counts the instances on the key's wait list, and
	// ThisInstanceWaiting says whether this locker's instance is one of them.
	InstancesWaiting    int
	ThisInstanceWaiting bool
	// Stored is what the key's ReplayKey holds (nil: nothing).
	Stored *Stored
	// InDoubt: a run record whose holder has no live lease: the run may or
	// may not have happened, so duplicates are refused until the record
	// ends or is cleared (ClearReplay).
	InDoubt bool
}

// Stored is the value under a lock key's ReplayKey: an answer stored for
// replay (the caller's opaque string), a run record, or a value of
// another Redis type that the engine did not write.
type Stored struct {
	Type string        // its Redis type ("string" when the engine wrote it)
	TTL  time.Duration // until it expires (ms precision; <0: no expiry)
	Size int64         // a string value's bytes (0 for another type)
	// Head is a string value's first 8 KiB; a run record's is its format
	// alone ("run1"): the record holds its holder's token.
	Head string
	// Run: it is a run record, not a stored answer.
	Run bool
}

// Removal is one server's answer to ForceRelease (holders removed) or
// ClearReplay (keys deleted), or its error.
type Removal struct {
	Count int64
	Err   error
}

// Errors.

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
// the lock could not be taken in time. It carries what Redis said of the
// holder (its lease left, how long it has held the lock, the other
// instances waiting) and the requests of this instance that queued before
// this one: the handler estimates Retry-After from them.
type BusyError struct {
	err   error
	facts busyFacts
	ahead int
}

func (e *BusyError) Error() string { return e.err.Error() }

func (e *BusyError) Unwrap() error { return e.err }

// LeaseLeft is the time until the holder's lease ends (0 when unknown);
// with permits, the lease that ends first.
func (e *BusyError) LeaseLeft() time.Duration { return e.facts.leaseLeft }

// Held is how long the current holder has held the lock, by the Redis
// server's clock from the TIME of its grant (the holder may be on another
// instance); with permits, the holder granted first. Over a Redlock quorum
// it is the earliest grant among the servers that answered busy. false
// when unknown.
func (e *BusyError) Held() (time.Duration, bool) { return e.facts.held, e.facts.held >= 0 }

// Ahead is the requests of this instance that queued before this one.
func (e *BusyError) Ahead() int { return e.ahead }

// OthersWaiting is the other Caddy instances in the key's Redis wait list
// (each waits with at least one request).
func (e *BusyError) OthersWaiting() int { return e.facts.others }

// ErrRunMismatch: under replay, the key's run was started by another
// request (its fingerprint differs).
var ErrRunMismatch = errors.New("redisdlm: the key's run was started by another request")

// InDoubtError is what Acquire returns for a Run whose key was run already
// by a holder that no longer holds a live lease (paused or crashed past
// it, or force-released) and left no answer: that run may or may not
// have happened, so this one must not start.
type InDoubtError struct{ left time.Duration }

func (e *InDoubtError) Error() string {
	return "redisdlm: the key's run started earlier and its outcome is unknown (its holder lost its lease before an answer was stored)"
}

// RecordLeft is how long the run record that keeps the key in doubt still
// lives.
func (e *InDoubtError) RecordLeft() time.Duration { return e.left }

// Replayed is what Acquire returns when an earlier holder's answer is
// stored for the key: the request is answered with it, no lock is taken.
type Replayed struct{ answer string }

func (r *Replayed) Error() string { return "redisdlm: answered from a stored response" }

// Answer is the earlier holder's stored answer.
func (r *Replayed) Answer() string { return r.answer }

// The clock.

// Clock is where the engine reads the time for what it computes from it: a
// lease's validity (ttl − elapsed, − drift with Redlock), the keeper's
// schedule (every ttl/3, until max_hold) and a busy lock's hint of when it
// is free. Timers and the calls' timeouts run on real time. Engine tests
// move a fake one instead of sleeping.
type Clock interface {
	Now() time.Time
}

// What the handler's tests set and read of the engine beyond its use.

// Clients returns the clients of the locker's servers, in config order.
func (l *Locker) Clients() []redis.UniversalClient { return l.clients() }

// InstanceID is this instance's id in the lock's Redis wait lists.
func (l *Locker) InstanceID() string { return l.dom.id }

// Extend extends ls once on every server, as its keeper does every ttl/3:
// ErrLeaseLost when a majority no longer holds it for ls or its validity
// ended, ErrUnavailable when too few servers answered.
func (l *Locker) Extend(ctx context.Context, ls *Lease) error { return l.extend(ctx, ls) }

// SetLogger replaces the locker's logger (a test quiets the one Caddy gives
// a module provisioned without a config, or records its lines).
func (l *Locker) SetLogger(lg *slog.Logger) { l.logger = lg }

// QueuedCalls is how many acquires and releases wait in the pipes of the
// locker's servers for a pipeline.
func (l *Locker) QueuedCalls() int { return l.queuedCalls() }

// NewBusyError is the error of a lock not taken in time (wrapping err),
// with the holder's lease left, how long it has held the lock (<0:
// unknown), the requests ahead here and the other instances waiting.
func NewBusyError(err error, leaseLeft, held time.Duration, ahead, others int) *BusyError {
	return &BusyError{err: err, facts: busyFacts{at: time.Now(), leaseLeft: leaseLeft, held: held, others: others}, ahead: ahead}
}

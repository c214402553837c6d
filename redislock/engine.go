package redislock

// The lock engine (internal/lock) as redis_lock uses it.

import (
	"github.com/caddy-dlm/redisdlm/internal/lock"
)

// Sentinel errors of the lock engine; compare with errors.Is.
var (
	// ErrNotObtained: the lock stayed busy for the whole wait.
	ErrNotObtained = lock.ErrNotObtained
	// ErrTooManyWaiters: max_waiters local waiters already queue for the key.
	ErrTooManyWaiters = lock.ErrTooManyWaiters
	// ErrUnavailable: Redis (or a quorum of Redlock servers) could not be reached.
	ErrUnavailable = lock.ErrUnavailable
	// ErrLeaseLost: an extension found that the lease is no longer held.
	ErrLeaseLost = lock.ErrLeaseLost
)

// The engine's types, under the names the handler's code uses.
type (
	locker      = lock.Locker
	lease       = lock.Lease
	server      = lock.Server
	busyError   = lock.BusyError
	replayed    = lock.Replayed
	lockOptions = lock.Options
)

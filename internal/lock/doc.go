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
// client to inject faults and move time without sleeping. Its files are
// listed once, in docs/design.md.
package lock

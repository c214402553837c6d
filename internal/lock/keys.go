package lock

// The Redis key names of the lock engine, beside a lock key.

import (
	"crypto/sha256"
	"encoding/hex"
)

// FenceKey is the fencing counter of a lock key; WaitqKey the list of
// instances waiting for it. Both share the lock key's hash tag.
func FenceKey(lockKey string) string  { return lockKey + ":fence" }
func ReplayKey(lockKey string) string { return lockKey + ":replay" }
func WaitqKey(lockKey string) string  { return lockKey + ":waitq" }

// DeadKey holds the tokens of attempts given up while their outcome was
// unknown: the acquire script never grants them (see lock_acquire.lua).
func DeadKey(lockKey string) string { return lockKey + ":dead" }

// DelayKey holds the lock_delay ends of a lock key: after a lease ends
// without its holder's release, nobody is granted it until then (see
// lock_acquire.lua).
func DelayKey(lockKey string) string { return lockKey + ":delay" }

// WakeID is how a wake-up names a lock key on the Pub/Sub channel: an
// opaque digest, so a client of a shared Redis that subscribes learns
// nothing of the keys (user ids, paths) being locked.
func WakeID(lockKey string) string {
	sum := sha256.Sum256([]byte(lockKey))
	return hex.EncodeToString(sum[:16])
}

package redisdlm

// The Redis key names of the lock engine, beside a lock key.

import (
	"crypto/sha256"
	"encoding/hex"
)

// fenceKey is the fencing counter of a lock key; waitqKey the list of
// instances waiting for it. Both share the lock key's hash tag.
func fenceKey(lockKey string) string  { return lockKey + ":fence" }
func replayKey(lockKey string) string { return lockKey + ":replay" }
func waitqKey(lockKey string) string  { return lockKey + ":waitq" }

// deadKey holds the tokens of attempts given up while their outcome was
// unknown: the acquire script never grants them (see lock_acquire.lua).
func deadKey(lockKey string) string { return lockKey + ":dead" }

// wakeID is how a wake-up names a lock key on the Pub/Sub channel: an
// opaque digest, so a client of a shared Redis that subscribes learns
// nothing of the keys (user ids, paths) being locked.
func wakeID(lockKey string) string {
	sum := sha256.Sum256([]byte(lockKey))
	return hex.EncodeToString(sum[:16])
}

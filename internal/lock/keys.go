package lock

// The Redis key names of the lock engine, beside a lock key.

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
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

// names is a lock key with its companions (FenceKey, WaitqKey, ReplayKey,
// DeadKey, DelayKey of it), made in one allocation: every acquire and
// release names all six.
type names struct{ lease, fence, waitq, replay, dead, delay string }

func keyNames(k string) names {
	var b strings.Builder
	b.Grow(5*len(k) + len(":fence:waitq:replay:dead:delay"))
	for _, sfx := range [...]string{":fence", ":waitq", ":replay", ":dead", ":delay"} {
		b.WriteString(k)
		b.WriteString(sfx)
	}
	all, n := b.String(), len(k)
	cut := func(from, sfx int) (string, int) { return all[from : from+n+sfx], from + n + sfx }
	ks := names{lease: k}
	at := 0
	ks.fence, at = cut(at, len(":fence"))
	ks.waitq, at = cut(at, len(":waitq"))
	ks.replay, at = cut(at, len(":replay"))
	ks.dead, at = cut(at, len(":dead"))
	ks.delay, _ = cut(at, len(":delay"))
	return ks
}

// acquireKeys are the acquire script's KEYS (lock_acquire.lua).
func (ks names) acquireKeys() []string {
	return []string{ks.lease, ks.fence, ks.waitq, ks.replay, ks.dead, ks.delay}
}

// releaseKeys are the release scripts' KEYS (lock_release.lua).
func (ks names) releaseKeys() []string {
	return []string{ks.lease, ks.fence, ks.replay, ks.waitq, ks.dead, ks.delay}
}

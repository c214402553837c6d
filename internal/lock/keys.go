package lock

// The Redis key names of the lock engine, beside a lock key.

import (
	"crypto/sha256"
	"encoding/hex"
)

// The companions' suffixes, in the order of names below.
const (
	fenceSuffix  = ":fence"
	waitqSuffix  = ":waitq"
	replaySuffix = ":replay"
	deadSuffix   = ":dead"
	delaySuffix  = ":delay"
)

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

// appendWakeID appends WakeID(lockKey) to b.
func appendWakeID(b []byte, lockKey string) []byte {
	sum := sha256.Sum256([]byte(lockKey))
	return hex.AppendEncode(b, sum[:16])
}

// wakeIDAndMessage is WakeID(lockKey) and the wake-up that announces a
// release of it by the domain with id, "<id> <WakeID>" (see WakeChannel),
// in one allocation: the ID is the message's tail.
func wakeIDAndMessage(id, lockKey string) (wakeID, msg string) {
	var buf [80]byte
	b := append(buf[:0], id...)
	b = appendWakeID(append(b, ' '), lockKey)
	msg = string(b)
	return msg[len(id)+1:], msg
}

// names is a lock key with its companions (FenceKey, WaitqKey, ReplayKey,
// DeadKey, DelayKey of it), made in one allocation: every acquire and
// release names all six.
type names struct{ lease, fence, waitq, replay, dead, delay string }

func keyNames(k string) names {
	// One concatenation is one allocation; each name is a slice of it.
	all := k + fenceSuffix + k + waitqSuffix + k + replaySuffix + k + deadSuffix + k + delaySuffix
	var cut [5]string
	at := 0
	for i, sfx := range [5]string{fenceSuffix, waitqSuffix, replaySuffix, deadSuffix, delaySuffix} {
		end := at + len(k) + len(sfx)
		cut[i], at = all[at:end], end
	}
	return names{lease: k, fence: cut[0], waitq: cut[1], replay: cut[2], dead: cut[3], delay: cut[4]}
}

// acquireKeys are the acquire script's KEYS (lock_acquire.lua).
func (ks names) acquireKeys() []string {
	return []string{ks.lease, ks.fence, ks.waitq, ks.replay, ks.dead, ks.delay}
}

// releaseKeys are the release scripts' KEYS (lock_release.lua).
func (ks names) releaseKeys() []string {
	a := ks.releaseKeyArray()
	return a[:]
}

// releaseKeyArray is releaseKeys in an array (in a caller's allocation).
func (ks names) releaseKeyArray() [6]string {
	return [6]string{ks.lease, ks.fence, ks.replay, ks.waitq, ks.dead, ks.delay}
}

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
// release names all six. all holds the companions one after the other, in
// the order of companionSuffixes; the zero names is none (all is never
// empty).
type names struct{ lease, all string }

// companionSuffixes are the companions' suffixes, in names.all's order.
var companionSuffixes = [5]string{fenceSuffix, waitqSuffix, replaySuffix, deadSuffix, delaySuffix}

func keyNames(k string) names {
	// One concatenation is one allocation; each name is a slice of it.
	return names{lease: k, all: k + fenceSuffix + k + waitqSuffix + k + replaySuffix + k + deadSuffix + k + delaySuffix}
}

// companions are the fence, waitq, replay, dead and delay keys.
func (ks names) companions() (c [5]string) {
	at := 0
	for i, sfx := range companionSuffixes {
		end := at + len(ks.lease) + len(sfx)
		c[i], at = ks.all[at:end], end
	}
	return c
}

// acquireKeyArray are the acquire script's KEYS (lock_acquire.lua), in an
// array (in a caller's allocation).
func (ks names) acquireKeyArray() [6]string {
	c := ks.companions()
	return [6]string{ks.lease, c[0], c[1], c[2], c[3], c[4]}
}

// releaseKeyArray are the release scripts' KEYS (lock_release.lua), in an
// array (in a caller's allocation).
func (ks names) releaseKeyArray() [6]string {
	c := ks.companions()
	return [6]string{ks.lease, c[0], c[2], c[1], c[3], c[4]}
}

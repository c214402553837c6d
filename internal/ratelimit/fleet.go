package ratelimit

import "time"

// The heartbeats of the instances that share a prefix (fail_local's N).
const (
	// HeartbeatEvery is how often an instance records its heartbeat.
	HeartbeatEvery = time.Second
	// HeartbeatLife is how long a heartbeat lives, about three periods: an
	// instance that stops (or whose Redis link broke) no longer counts
	// after it.
	HeartbeatLife = 3 * HeartbeatEvery
)

// ReturnCap is how long an instance back from local mode holds every key
// to its local share as well as to Redis's decision: the other instances
// come back within it (in local mode they try Redis ten times a second) and
// charge what they admitted locally, which Redis does not know until then
// (without the cap, Redis would admit n less only what the instances back
// already charged, and the fleet up to n plus the others' uncharged
// admissions in the window of the return).
//
// The return begins when Redis may answer this instance again: when local
// mode starts (an outage may be short), when a heartbeat is answered after
// one was not, and when the hold after a restart of Redis ends (the others
// end theirs about then, and charge their last local admissions after
// it). The first Redis decisions after local mode, the breaker's probe
// included, are the return's too: an instance that admitted its share
// locally and then let Redis decide alone would admit more than its share
// in the window while the others' latest local admissions are still on
// their way. Local mode still ends with the first Redis decision, at most
// ReturnCap after Redis answers again (its probe is not held once that
// second is over), and the cap holds for ReturnCap after that as well.
const ReturnCap = time.Second

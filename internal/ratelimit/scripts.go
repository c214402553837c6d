package ratelimit

import (
	_ "embed"
	"fmt"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

// The rate limiter's Lua scripts: two decision scripts, each put together
// from the batch driver and an algorithm's body (they take a batch, see
// multi.go), and the two that return an admission.
var (
	//go:embed scripts/ratelimit_batch.lua
	batchLua string
	//go:embed scripts/ratelimit_sliding.lua
	slidingLua string
	//go:embed scripts/ratelimit_gcra.lua
	gcraLua string
	//go:embed scripts/ratelimit_sliding_return.lua
	slidingReturnLua string
	//go:embed scripts/ratelimit_gcra_return.lua
	gcraReturnLua string

	SlidingScript       = redisconn.NewScript(decisionScript(slidingLua, perSliding))
	GCRAScript          = redisconn.NewScript(decisionScript(gcraLua, perGCRA))
	SlidingReturnScript = redisconn.NewScript(slidingReturnLua)
	GCRAReturnScript    = redisconn.NewScript(gcraReturnLua)
)

// The integers a decision's answer has per rate (after its first two).
const (
	perSliding = 2 // remaining, reset
	perGCRA    = 4 // remaining, reset, the TAT written, the key's sum of returns
)

// The codes of a decision in a batch that failed (e.g. on a key of another
// type): failedRead when nothing of it was written (it is sent again alone,
// so that it gets Redis's own error), failedRun when it failed after writing
// part of it (it gets ErrFailedRun). The decision scripts get them from
// here (decisionScript).
const (
	failedRead = -1 << 62
	failedRun  = -1 << 61
)

// BanState says whether a rejection is a ban's (see Decision.Ban); the
// decision scripts answer it after a rejection's wait, as the constants
// BANNED and BAN_STARTED (decisionScript).
type BanState int64

const (
	NotBanned  BanState = iota // rejected by a rate, no ban
	Banned                     // rejected outright: the key is under a ban
	BanStarted                 // rejected by a rate, and so the ban starts now
)

// ordered is what a decision script answers in the place of the BanState
// of a rejection that the order of a log made, or made longer
// (ratelimit_sliding.lua: an admission held until later, by a handler
// sharing the key, comes first): one that may not last (Decision.Ordered).
const ordered = 3

// bodyMark is the line of ratelimit_batch.lua where an algorithm's body goes.
const bodyMark = "-- @body\n"

// decisionScript puts a decision script together: the constants named in Go,
// the batch driver up to its body mark, the algorithm's body (answering per
// integers per rate), the rest of the driver.
func decisionScript(body string, per int) string {
	head, tail, ok := strings.Cut(batchLua, bodyMark)
	if !ok {
		panic("ratelimit: scripts/ratelimit_batch.lua has no body mark")
	}
	consts := fmt.Sprintf("local FAILED_READ, FAILED_RUN, PER, BANNED, BAN_STARTED, ORDERED = %d, %d, %d, %d, %d, %d\n",
		failedRead, failedRun, per, Banned, BanStarted, ordered)
	return consts + head + body + tail
}

// decisionScripts take a batch; other scripts (returning an admission) are
// always sent alone. The value is how many integers a decision's answer
// has per rate (after its first two).
var decisionScripts = map[*redisconn.Script]int{SlidingScript: perSliding, GCRAScript: perGCRA}

// PerRate is how many integers a decision script's answer has per rate
// (after its first two); 0 for a script that takes no batch.
func PerRate(s *redisconn.Script) int { return decisionScripts[s] }

// PerRate is how many integers the answer of decision c has per rate
// (after its first two): its script's, or 2 when its answer is lean (the
// remaining quota and when it grows; not what returning it would need).
func (c *Call) PerRate() int {
	if c.Lean && decisionScripts[c.Script] > 2 {
		return 2
	}
	return decisionScripts[c.Script]
}

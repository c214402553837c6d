package ratelimit

import (
	_ "embed"
	"fmt"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

// The rate limiter's Lua scripts. Each algorithm's decision script is put
// together from the batch driver and the algorithm's body (it takes a
// batch, see multi.go; newDecisionScript); its other scripts, and those of
// the fleet and the admin API, are sent alone.
var (
	//go:embed scripts/ratelimit_batch.lua
	batchLua string
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

// decisionScripts are the decision scripts, which take a batch, each with
// how many integers a decision's answer has per rate (after its first two);
// other scripts (returning an admission, charging, the fleet's, the admin
// API's) are always sent alone.
var decisionScripts = map[*redisconn.Script]int{}

// newDecisionScript makes the decision script of an algorithm's body.
func newDecisionScript(body string, per int) *redisconn.Script {
	s := redisconn.NewScript(decisionScript(body, per))
	decisionScripts[s] = per
	return s
}

// perRate is how many integers the answer of decision c has per rate
// (after its first two): its script's, or 2 when its answer is lean (the
// remaining quota and when it grows; not what returning it would need); 0
// for a call that is no decision.
func (c *Call) perRate() int {
	if c.lean && decisionScripts[c.script] > 2 {
		return 2
	}
	return decisionScripts[c.script]
}

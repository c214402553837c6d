package lock

// One owner-checked release of one key on one server.

import (
	"context"
	"errors"
	"strings"

	"github.com/redis/go-redis/v9"
)

// releaseJob is one owner-checked release of one key on one server.
type releaseJob struct {
	key, token string
	msg        string // wake-up announced when it removes the lease and another instance waits; "" for none
	self       string // the releasing instance (domain) id
	raise      int64  // fencing counter to write back (Redlock); 0 for none
	ttlMs      int64
	handler    string // the handler's name, for the log lines ("" for none)
	// answer is the holder's answer to store for replay ("" for none),
	// kept replayMs.
	answer   string
	replayMs int64
	// unknown: the acquisition's answer was lost, so the lease may appear
	// after a first release found nothing (the acquire script can still be
	// on its way to the server, on another connection): the release then
	// also marks the token dead, so that acquire takes nothing when it
	// arrives, and a "not held" answer is confirmed once more a little later.
	unknown bool
	// unclean: the holder did not finish cleanly (its client went away
	// while the route ran, or it lost the lease): with delayMs > 0 nobody
	// gets the key for that long after the release (lock_delay).
	unclean bool
	delayMs int64
	// clearRun: a run record of this token under the key (replay) is
	// deleted, so another request may run the key: the run did not
	// happen or failed, or the attempt never ran (an undo).
	clearRun bool
}

// isOOM reports whether Redis refused a call for being over maxmemory.
func isOOM(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.HasPrefix(re.Error(), "OOM ")
}

// run sends the release; it reports whether the token was removed. A
// release that stores an answer for replay (up to replay_max) is refused
// over maxmemory, and then releases without storing it.
func (j releaseJob) run(ctx context.Context, s *Server) (bool, error) {
	script := releaseScript
	if j.answer != "" {
		script = releaseStoreScript
	}
	keys := keyNames(j.key).releaseKeyArray()
	var args [releaseArgs]any
	j.fill(&args)
	n, err := script.Run(ctx, s.batched(), keys[:], args[:]...).Int64()
	if j.answer != "" && isOOM(err) {
		j.answer = ""
		return j.run(ctx, s)
	}
	return n == 1, err
}

// releaseCall holds the keys and the whole argument list of a release
// nobody waits for (they must stay as they are until it is answered; see
// redisconn.Script.Argv).
type releaseCall struct {
	keys [6]string
	argv [3 + 6 + releaseArgs]any
	to   releaseSettler
}

// releaseSettler is what a release nobody waits for reports to once the
// server answered: what run would return.
type releaseSettler interface {
	settle(removed bool, err error)
}

// start sends a release that stores no answer without waiting for it
// (j and c must stay as they are until then): to hears what run would
// return, on a goroutine spawn started (see redisconn.Sender), so it must
// neither block nor panic. ks are the names of j's key, when known (the
// zero names otherwise).
func (j *releaseJob) start(s *Server, c *releaseCall, ks names, spawn func(func()), to releaseSettler) {
	if ks.all == "" || ks.lease != j.key {
		ks = keyNames(j.key)
	}
	c.keys = ks.releaseKeyArray()
	var args [releaseArgs]any
	j.fill(&args)
	c.to = to
	releaseScript.Go(s.batched(), releaseScript.Argv(c.argv[:0], c.keys[:], args[:]...), spawn, c.answered)
}

func (c *releaseCall) answered(cmd *redis.Cmd) {
	n, err := cmd.Int64()
	c.to.settle(n == 1, err)
}

// releaseArgs is the number of the release scripts' arguments.
const releaseArgs = 12

// fill writes the release script's arguments into a.
func (j *releaseJob) fill(a *[releaseArgs]any) {
	dead := int64(0)
	if j.unknown {
		// Kept as long as the releaser would retry this undo: an attempt
		// delayed on its way to Redis is refused until then.
		dead = 2*j.ttlMs + releaseGiveUpExtra.Milliseconds()
	}
	*a = [releaseArgs]any{&j.token, WakeChannel, &j.msg, j.raise, &j.ttlMs, &j.answer, &j.replayMs, &j.self, dead, flagArg(j.unclean), &j.delayMs, flagArg(j.clearRun)}
}

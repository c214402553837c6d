package lock

// Releasing: the owner-checked release fan-out, and the releases a server
// did not answer, retried in the background until it does, so a lost
// answer (a timeout, a pause, a failover, a client that went away) never
// leaves a lease held until its ttl runs out.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/throttle"
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
}

// ReleaseStoreScript is the release script without allow-oom, for a
// release that stores an answer for replay: that one can grow memory.
var ReleaseStoreScript = redisconn.NewScript(strings.Replace(releaseLua, "#!lua flags=allow-oom\n", "#!lua\n", 1))

// isOOM reports whether Redis refused a call for being over maxmemory.
func isOOM(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.HasPrefix(re.Error(), "OOM ")
}

// run sends the release; it reports whether the token was removed. A
// release that stores an answer for replay (up to replay_max) is refused
// over maxmemory, and then releases without storing it.
func (j releaseJob) run(ctx context.Context, s *Server) (bool, error) {
	script := ReleaseScript
	if j.answer != "" {
		script = ReleaseStoreScript
	}
	dead := int64(0)
	if j.unknown {
		// Kept as long as the releaser would retry this undo: an attempt
		// delayed on its way to Redis is refused until then.
		dead = 2*j.ttlMs + releaseGiveUpExtra.Milliseconds()
	}
	n, err := script.Run(ctx, s.client, []string{j.key, FenceKey(j.key), ReplayKey(j.key), WaitqKey(j.key), DeadKey(j.key)},
		j.token, WakeChannel, j.msg, j.raise, j.ttlMs, j.answer, j.replayMs, j.self, dead).Int64()
	if j.answer != "" && isOOM(err) {
		j.answer = ""
		return j.run(ctx, s)
	}
	return n == 1, err
}

// releaseKeys releases token on keys on every server, in parallel. It
// returns as soon as a majority released each key; a server that fails or
// does not answer in time gets the release again in the background.
//
// With one key and removed not nil, bit i of removed is set when server i
// answers that it removed the token. unknown marks the undo of an
// acquisition whose outcome is not known; answer (one key only) is stored
// for replay.
func (l *Locker) releaseKeys(keys []string, token string, raise int64, removed *atomic.Uint64, wake, unknown bool, answer string) {
	jobs := make([]releaseJob, len(keys))
	for i, k := range keys {
		jobs[i] = l.releaseJob(k, token)
		jobs[i].raise, jobs[i].unknown, jobs[i].answer = raise, unknown, answer
		if wake {
			jobs[i].msg = l.dom.id + " " + WakeID(k)
		}
	}
	l.releaseJobs(jobs, nil, removed)
}

// releaseJob is the release of token on key k, with nothing to write back,
// announce or store.
func (l *Locker) releaseJob(k, token string) releaseJob {
	return releaseJob{key: k, token: token, ttlMs: l.opts.TTL.Milliseconds(), replayMs: l.opts.Replay.Milliseconds(),
		self: l.dom.id, handler: l.opts.Handler}
}

// notAsked is the answer of a server that a release skips.
type notAsked struct{}

// releaseJobs runs jobs (one per key) on every server, in parallel, as
// releaseKeys says; bit i of skip[j] (skip may be nil) spares server i
// the release of jobs[j]: it is known to hold nothing of it.
func (l *Locker) releaseJobs(jobs []releaseJob, skip []uint64, removed *atomic.Uint64) {
	one := func(job releaseJob, skip uint64) {
		res := l.callAll(context.Background(), func(ctx context.Context, i int, s *Server) (any, error) {
			if skip&(1<<i) != 0 {
				return notAsked{}, nil
			}
			cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
			defer cancel()
			ok, err := job.run(cctx, s)
			if err == nil && ok && removed != nil && len(jobs) == 1 {
				removed.Or(1 << i)
			}
			return ok, err
		}, l.majorityAnswered, func(i int, r result) { l.settleRelease(i, job, r) })
		for i, r := range res {
			if r.done {
				l.settleRelease(i, job, r)
			}
		}
	}
	skipOf := func(j int) uint64 {
		if skip == nil {
			return 0
		}
		return skip[j]
	}
	if len(jobs) == 1 {
		one(jobs[0], skipOf(0))
		return
	}
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Add(1)
		go func(j releaseJob, skip uint64) {
			defer wg.Done()
			defer l.recoverPanic("releasing a lock key")
			one(j, skip)
		}(j, skipOf(i))
	}
	wg.Wait()
}

// settleRelease queues job again on server i when its answer r needs it:
// a failure, or "not held" for an outcome nobody knows (confirmed again a
// little later).
func (l *Locker) settleRelease(i int, job releaseJob, r result) {
	if _, skipped := r.v.(notAsked); skipped {
		return
	}
	if r.err != nil {
		l.servers[i].rel.retry(job, r.err)
	} else if job.unknown && !r.v.(bool) {
		l.servers[i].rel.retry(job, nil)
	}
}

// releaseOn releases token on one key of server i (a late grant, or a
// late answer that was lost): in the background until the server answers.
func (l *Locker) releaseOn(i int, k, token string, unknown bool) {
	job := l.releaseJob(k, token)
	job.unknown = unknown
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
	defer cancel()
	if removed, err := job.run(ctx, l.servers[i]); err != nil || (unknown && !removed) {
		l.servers[i].rel.retry(job, err)
	}
}

// Retrying releases.
const (
	releaseRetryMin = 50 * time.Millisecond
	releaseRetryMax = 400 * time.Millisecond
	// releaseConfirm: an unknown outcome's "not held" answer is checked
	// again after this long.
	releaseConfirm = 200 * time.Millisecond
	// releaseGiveUpExtra: a release is retried for 2 × ttl plus this long.
	releaseGiveUpExtra = 10 * time.Second
	// releaseBatch bounds the releases sent in one pipeline.
	releaseBatch = 256
)

// releaser holds the releases one server still owes and retries them, in
// one pipeline per round, until the server answers. A job is given up
// 2 × ttl + 10s after it was first queued: by then the lease has run out
// unless the server was frozen that long (then it holds it for at most one
// more ttl after it thaws).
type releaser struct {
	s    *Server
	warn *throttle.Warnings

	mu      sync.Mutex
	pending map[releaseJob]*releaseState
	running bool
}

type releaseState struct {
	giveUp  time.Time
	confirm time.Time // unknown outcome answered "not held": ask again then
}

// retry queues job (err is why it failed; nil for a confirmation). Only
// releases of leases that were held, or whose acquire outcome is unknown,
// come here: a failure is counted and logged (at most every 10 s, naming
// the handler, the server and the key's hash; the key itself at debug).
func (r *releaser) retry(job releaseJob, err error) {
	if err != nil {
		if r.s.onReleaseFailure != nil {
			r.s.onReleaseFailure(job.handler)
		}
		lg := r.s.logger()
		if due, n := r.warn.Due(); due && lg != nil {
			lg.Warn("releasing a lock failed; retrying in the background until redis answers",
				append(r.jobFields(job), slog.Any("error", err), slog.Int64("failures_since_last_warning", n))...)
		}
		if lg != nil && lg.Enabled(context.Background(), slog.LevelDebug) {
			lg.Debug("releasing a lock failed", append(r.jobFields(job), slog.String("key", job.key), slog.Any("error", err))...)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pending == nil {
		r.pending = map[releaseJob]*releaseState{}
	}
	if _, ok := r.pending[job]; !ok {
		st := &releaseState{giveUp: time.Now().Add(2*time.Duration(job.ttlMs)*time.Millisecond + releaseGiveUpExtra)}
		if err == nil {
			st.confirm = time.Now().Add(releaseConfirm)
		}
		r.pending[job] = st
	}
	if !r.running {
		r.running = true
		r.s.conn.Use() // the client stays open while releases are owed
		go r.run()
	}
}

// jobFields name a job's handler, server and key (hashed) in a log line.
func (r *releaser) jobFields(job releaseJob) []any {
	return []any{slog.String("handler", job.handler), slog.String("server", r.s.name), slog.String("key_hash", WakeID(job.key))}
}

// pendingCount is how many releases are owed (for tests and the admin API).
func (r *releaser) pendingCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pending)
}

// run retries the pending releases until none is left. A panic in a round
// is logged and the round counts as failed: the runner goes on, so the
// releases still owed keep their runner (no lock is held while it
// recovers).
func (r *releaser) run() {
	defer r.s.conn.Unuse()
	wait := releaseRetryMin
	for r.round(&wait) {
		time.Sleep(wait)
	}
}

// round sends the releases that are due; it reports whether releases are
// still owed, and sets wait to the delay before the next round.
func (r *releaser) round(wait *time.Duration) (owed bool) {
	defer func() {
		if p := recover(); p != nil {
			r.logPanic(p)
			*wait = releaseRetryMax
			owed = r.owed()
		}
	}()
	jobs, gaveUp, owed := r.due()
	for _, j := range gaveUp {
		if lg := r.s.logger(); lg != nil {
			lg.Error("gave up releasing a lock: redis did not answer; the lease runs out by itself", r.jobFields(j)...)
		}
	}
	if !owed {
		return false
	}
	if len(jobs) > 0 {
		if r.send(jobs) {
			*wait = releaseRetryMin
		} else if *wait *= 2; *wait > releaseRetryMax {
			*wait = releaseRetryMax
		}
	}
	return true
}

// due takes the pending releases that are due (up to releaseBatch) and
// drops those given up. When none is left, the runner ends (owed false).
func (r *releaser) due() (jobs, gaveUp []releaseJob, owed bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	for j, st := range r.pending {
		switch {
		case now.After(st.giveUp):
			delete(r.pending, j)
			gaveUp = append(gaveUp, j)
		case st.confirm.After(now):
		case len(jobs) < releaseBatch:
			jobs = append(jobs, j)
		}
	}
	return jobs, gaveUp, r.owedLocked()
}

// owed reports whether releases are still pending; when none is, the
// runner ends.
func (r *releaser) owed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.owedLocked()
}

func (r *releaser) owedLocked() bool {
	if len(r.pending) == 0 {
		r.running = false
		return false
	}
	return true
}

// logPanic logs a panic of the runner with its stack; a logger that
// panics too is ignored.
func (r *releaser) logPanic(p any) {
	defer func() { _ = recover() }()
	if lg := r.s.logger(); lg != nil {
		lg.Error("panic in the lock releaser; recovered", slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
	}
}

// send runs one round of jobs in a pipeline and settles the answered ones.
func (r *releaser) send(jobs []releaseJob) (progress bool) {
	ctx, cancel := context.WithTimeout(context.Background(), r.s.timeout)
	defer cancel()
	type call struct {
		removed bool
		err     error
	}
	out := make([]call, len(jobs))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Add(1)
		go func(i int, j releaseJob) {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					out[i].err = fmt.Errorf("redisdlm: panic releasing a lock: %v", p)
				}
			}()
			out[i].removed, out[i].err = j.run(ctx, r.s)
		}(i, j)
	}
	wg.Wait()
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, j := range jobs {
		st := r.pending[j]
		if st == nil || out[i].err != nil {
			continue
		}
		progress = true
		if j.unknown && !out[i].removed && st.confirm.IsZero() {
			st.confirm = time.Now().Add(releaseConfirm)
			continue
		}
		delete(r.pending, j)
	}
	return progress
}

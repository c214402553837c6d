package lock

// A server's background releaser: the releases the server did not answer,
// retried until it does, so a lost answer (a timeout, a pause, a failover, a
// client that went away) never leaves a lease held until its ttl runs out.

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/throttle"
)

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

package lock

// A Locker's releases: the owner-checked release fan-out; what a server
// does not answer goes to its background releaser.

import (
	"context"
	"sync"
	"sync/atomic"
)

// leaseRelease is the release of a held lease.
type leaseRelease struct {
	keys  []string
	msgs  []string // the wake-up of each key (its queue's wakeMsgs); nil: made here
	token string
	raise int64 // Redlock: the fencing counter to write back (0: none)
	// removed, with one key: bit i is set when server i answers that it
	// removed the token.
	removed *atomic.Uint64
	// unknown: some server may hold the lease in a way nobody knows (see
	// Lease.outcomeUnknown), so the token is marked dead too.
	unknown bool
	answer  string // the holder's answer to store for replay (one key); "" for none
	// unclean: the holder did not finish cleanly; with lock_delay, nobody
	// gets the keys for the delay.
	unclean bool
	// clearRun: the lease's run record is deleted (see Lease.ClearRun).
	clearRun bool
}

// releaseLease releases a lease on every server, in parallel, and
// announces it to the waiters of other instances. It returns as soon as a
// majority released each key; a server that fails or does not answer in
// time gets the release again in the background.
func (l *Locker) releaseLease(r leaseRelease) {
	l.runReleaseJobs(l.releaseJobs(r), nil, r.removed)
}

// releaseJobs are the jobs of r, one per key.
func (l *Locker) releaseJobs(r leaseRelease) []releaseJob {
	jobs := make([]releaseJob, len(r.keys))
	for i := range r.keys {
		jobs[i] = l.leaseJob(r, i)
	}
	return jobs
}

// leaseJob is the job of r's key i.
func (l *Locker) leaseJob(r leaseRelease, i int) releaseJob {
	k := r.keys[i]
	job := l.releaseJob(k, r.token)
	job.raise, job.unknown, job.answer, job.unclean, job.clearRun = r.raise, r.unknown, r.answer, r.unclean, r.clearRun
	if r.msgs != nil {
		job.msg = r.msgs[i]
	} else {
		_, job.msg = wakeIDAndMessage(l.dom.id, k)
	}
	return job
}

// releaseJob is the release of token on key k, with nothing to write back,
// announce or store.
func (l *Locker) releaseJob(k, token string) releaseJob {
	// An attempt undone (or granted late) never ran: its run record, if
	// any, goes.
	return releaseJob{key: k, token: token, ttlMs: l.opts.TTL.Milliseconds(), replayMs: l.opts.Replay.Milliseconds(),
		self: l.dom.id, handler: l.opts.Handler, delayMs: l.opts.LockDelay.Milliseconds(), clearRun: l.opts.Replay > 0}
}

// notAsked is the answer of a server that a release skips.
type notAsked struct{}

// runReleaseJobs runs jobs (one per key) on every server, in parallel, as
// releaseLease says; bit i of skip[j] (skip may be nil) spares server i
// the release of jobs[j]: it is known to hold nothing of it.
func (l *Locker) runReleaseJobs(jobs []releaseJob, skip []uint64, removed *atomic.Uint64) {
	one := func(job releaseJob, skip uint64) {
		res := l.callAll(context.Background(), func(ctx context.Context, i int, s *Server) (any, error) {
			if skip&(1<<i) != 0 {
				return notAsked{}, nil
			}
			ok, err := job.run(ctx, s) // bounded by the pipe
			if err == nil && removed != nil && len(jobs) == 1 {
				bits := answeredBit(i)
				if ok {
					bits |= 1 << i
				}
				if prev := removed.Or(bits); !ok && prev&lateGrantBit(i) != 0 {
					// A grant that came late, overtaken by this release.
					l.releaseOn(i, job)
				}
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

// releaseOn runs job on server i alone (a late grant, or a late answer
// that was lost): in the background until the server answers.
func (l *Locker) releaseOn(i int, job releaseJob) {
	ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
	defer cancel()
	if removed, err := job.run(ctx, l.servers[i]); err != nil || (job.unknown && !removed) {
		l.servers[i].rel.retry(job, err)
	}
}

// keepAnswer is KeepAnswer.
func (ls *Lease) keepAnswer(ctx context.Context, answer string) (bool, error) {
	l := ls.l
	ctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
	defer cancel()
	n, err := keepAnswerScript.Run(ctx, l.servers[0].client, []string{ls.keys[0], ReplayKey(ls.keys[0])},
		ls.token, answer, l.opts.Replay.Milliseconds()).Int64()
	return n == 1, err
}

// abandon is Abandon.
func (ls *Lease) abandon() {
	ls.unclean.Store(true)
	ls.releaseWith("", releaseInBackground)
}

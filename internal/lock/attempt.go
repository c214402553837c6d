package lock

// One acquisition attempt of the lock engine: the acquire script on every
// key (sorted) and every server at once, decided by a majority, with WAIT
// for sync_replicas, the undo of a partial attempt, and the fencing
// write-back. redlock.go runs the attempts (Acquire, wait).

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
)

// attempt is the outcome of one acquisition attempt.
type attempt struct {
	lease      *Lease
	retryAfter time.Duration // when not acquired: until the earliest lease ends
	busy       busyFacts     // when not acquired: what Redis said of the holder
	busyKey    int           // when not acquired: index of the busy key
	// split: the attempt took part of what it needed (some servers or some
	// keys): a release was half done, or a rival did the same. After the
	// next wake-up the waiter retries only after a short random delay, so
	// two rivals do not collide again in step.
	split  bool
	err    error  // Redis unreachable / no quorum
	answer string // a stored answer to replay (replay on)
}

// tryAcquire makes one attempt on every key (sorted) and every server.
// All keys or none: when any key is busy, the keys taken are released.
//
// first is the index of the key that was busy last time: it is asked
// first, so a request for several keys does not take and give back its free
// keys again and again while one of them stays busy.
func (l *Locker) tryAcquire(ctx context.Context, keys []string, chain, first int) attempt {
	token := uuid.NewString()
	start := time.Now()
	ttlMs := l.opts.TTL.Milliseconds()
	life := l.waitqLife().Milliseconds()
	n := len(l.servers)
	var fence int64
	// A server that grants after the outcome was decided must not keep a
	// lease nobody owns: it is released there as soon as its answer comes,
	// if the attempt failed or the lease is already released — unless that
	// server's release already removed it (its grant came first there).
	var failed atomic.Bool
	released, removed, unknown := new(atomic.Bool), new(atomic.Uint64), new(atomic.Bool)
	var answer atomic.Pointer[string]
	// keyUnknown[j]: some server's answer for order[j] was lost in this
	// attempt, so its undo marks the token dead for that key.
	keyUnknown := make([]atomic.Bool, len(keys))
	// refused[j]: bit i is set when server i refused order[j] with an
	// answer (busy, or a call Redis refused without running it): it holds
	// nothing of this attempt there, so an undo has nothing to release on it.
	refused := make([]uint64, len(keys))
	// A late error is an outcome nobody knows: released in the background
	// if the attempt failed or the lease is gone already.
	lateGrant := func(j int, k string) func(i int, r result) {
		return func(i int, r result) {
			if unknownOutcome(r.err) {
				keyUnknown[j].Store(true)
				unknown.Store(true) // the lease's release marks the token dead there
			}
			if !failed.Load() && !released.Load() {
				return
			}
			switch {
			case r.err != nil && !refusedUnrun(r.err):
				l.releaseOn(i, k, token, unknownOutcome(r.err))
			case r.err == nil && r.v.([]int64)[0] == 1 && (len(keys) > 1 || removed.Load()&(1<<i) == 0):
				l.releaseOn(i, k, token, false)
			}
		}
	}
	order := make([]string, 0, len(keys))
	if first > 0 && first < len(keys) {
		order = append(order, keys[first])
		order = append(order, keys[:first]...)
		order = append(order, keys[first+1:]...)
	} else {
		order = append(order, keys...)
	}
	// undo gives back order[:n] on every server that may hold it, marking
	// the token dead for every key whose outcome was unknown anywhere in
	// the attempt (or for all, with allUnknown). A server that refused a
	// key gets no release of it: nothing is held there, and a release that
	// failed there would count as a failure.
	undo := func(n int, allUnknown bool) {
		var jobs []releaseJob
		var skip []uint64
		for j, k := range order[:n] {
			if refused[j] == 1<<len(l.servers)-1 {
				continue
			}
			job := l.releaseJob(k, token)
			job.unknown = allUnknown || keyUnknown[j].Load()
			jobs, skip = append(jobs, job), append(skip, refused[j])
		}
		if len(jobs) > 0 {
			l.releaseJobs(jobs, skip, removed)
		}
	}
	for i, k := range order {
		// Ask every server at once; stop as soon as the outcome is decided.
		results := l.callAll(ctx, func(ctx context.Context, _ int, s *Server) (any, error) {
			c := s.client
			keys := []string{k, FenceKey(k), WaitqKey(k), ReplayKey(k), DeadKey(k)}
			var v []int64
			var ans string
			var err error
			if l.opts.SyncReplicas > 0 {
				v, ans, err = l.acquireSynced(ctx, c, keys, token, ttlMs, life, chain, l.turnsFlag(len(order)))
			} else {
				cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
				defer cancel()
				v, ans, err = acquireReply(AcquireScript.Run(cctx, c, keys, token, ttlMs, l.opts.Permits, l.dom.id, life, chain, l.replayFlag(), l.turnsFlag(len(keys))))
			}
			if ans != "" {
				answer.Store(&ans)
			}
			return v, err
		}, func(res []result, _ int) bool {
			g, b, e := tally(res)
			return g >= l.quorum || b > n-l.quorum || e > n-l.quorum
		}, lateGrant(i, k))
		granted, busy, errs := tally(results)
		for si, r := range results {
			if r.done && ((r.err == nil && r.v.([]int64)[0] != 1) || refusedUnrun(r.err)) {
				refused[i] |= 1 << si
			}
		}
		if anyUnknown(results) {
			keyUnknown[i].Store(true)
			unknown.Store(true)
		}
		if a := answer.Load(); a != nil {
			return attempt{answer: *a}
		}
		if granted >= l.quorum {
			var keyMax int64
			for _, r := range results {
				if r.done && r.err == nil && r.v.([]int64)[0] == 1 && r.v.([]int64)[1] > keyMax {
					keyMax = r.v.([]int64)[1]
				}
			}
			if keyMax > fence {
				fence = keyMax
			}
			continue
		}
		failed.Store(true)
		// Not taken: give back what this attempt took, everywhere at once:
		// this key too, where its answer was lost or not yet in, and with
		// Redlock where a minority granted it.
		undo(i+1, false)
		if granted+busy < l.quorum {
			// Fewer than a majority answered at all: Redis is unreachable.
			var last error
			for _, r := range results {
				if r.err != nil {
					last = r.err
				}
			}
			if ctx.Err() != nil {
				return attempt{err: ctx.Err()}
			}
			return attempt{err: fmt.Errorf("%w: %d of %d servers failed: %v", ErrUnavailable, errs, n, last)}
		}
		var retry time.Duration
		facts := busyFacts{at: time.Now(), held: -1}
		for _, r := range results {
			if r.done && r.err == nil && r.v.([]int64)[0] == 0 {
				if d := time.Duration(r.v.([]int64)[1]) * time.Millisecond; d > retry {
					retry = d
				}
				facts.add(r.v.([]int64)[2:])
			}
		}
		facts.leaseLeft = retry
		busyIdx := 0
		for j, x := range keys {
			if x == k {
				busyIdx = j
			}
		}
		return attempt{retryAfter: retry, busy: facts, busyKey: busyIdx, split: granted > 0 || i > 0}
	}
	var raise int64
	if len(keys) == 1 && n > 1 {
		// Redlock: the highest counter goes back to the servers with the
		// release (in the same round trip), so the majority that sees the
		// key free next also sees the counter. A holder that dies before its
		// release leaves that to the time floor of the counters: the next
		// holder comes a full ttl later, so its token is higher unless the
		// servers' clocks disagree by more than the ttl.
		raise = fence
	} else if len(keys) > 1 {
		// Several keys: one token serves them all, so each key's counter
		// must reach it before the token is used (a max-register).
		if err := l.raiseFences(ctx, keys, fence); err != nil {
			failed.Store(true)
			// A minority of servers may not have answered the acquire:
			// undone as outcomes unknown.
			undo(len(order), true)
			return attempt{err: err}
		}
	}
	validity := l.opts.TTL - time.Since(start)
	if n > 1 {
		validity -= l.drift()
	}
	if validity <= 0 {
		failed.Store(true)
		undo(len(order), true)
		return attempt{retryAfter: 0}
	}
	return attempt{lease: &Lease{l: l, keys: keys, token: token, fence: fence - int64(chain) + 1, start: start,
		until: start.Add(validity), released: released, removed: removed, unknown: unknown, extending: new(atomic.Int32), chainLeft: chain - 1, raise: raise}}
}

// acquireSynced runs the acquire script and WAIT in one pipeline on the
// key's own master (WAIT counts the replicas that have this connection's
// writes; on a Cluster it goes to the master of the key's slot, not to a
// random one). WAIT's timeout is half the call's timeout, below the read
// timeout, so too few acknowledgements are an answer, not an i/o timeout.
// A grant that too few replicas acknowledged is an error: the caller's
// undo releases it, owner-checked, at once. A stored answer (replay) grants
// nothing, so it needs no acknowledgement.
func (l *Locker) acquireSynced(ctx context.Context, c redis.UniversalClient, keys []string, token string, ttlMs, life int64, chain int, turns string) ([]int64, string, error) {
	cctx, cancel := context.WithTimeout(ctx, 2*l.opts.Timeout)
	defer cancel()
	node := c
	if cc, ok := c.(*redis.ClusterClient); ok {
		m, err := cc.MasterForKey(cctx, keys[0])
		if err != nil {
			return nil, "", fmt.Errorf("sync_replicas: finding the key's master: %w", err)
		}
		node = m
	}
	waitMs := max((l.opts.Timeout / 2).Milliseconds(), 1) // 0 would block for ever
	pipe := node.Pipeline()
	acq := AcquireScript.Eval(cctx, pipe, keys, token, ttlMs, l.opts.Permits, l.dom.id, life, chain, l.replayFlag(), turns)
	wait := redis.NewIntCmd(cctx, "wait", l.opts.SyncReplicas, waitMs)
	_ = pipe.Process(cctx, wait)
	_, _ = pipe.Exec(cctx)
	v, ans, err := acquireReply(acq)
	if err != nil {
		return nil, "", err
	}
	if v[0] == 1 {
		n, err := wait.Result()
		switch {
		case err != nil:
			// %v: the grant stands, so this is no refusal of Redis's (see
			// refusedUnrun) whatever WAIT answered.
			err = fmt.Errorf("sync_replicas: waiting for replicas: %v", err)
		case n < int64(l.opts.SyncReplicas):
			err = fmt.Errorf("sync_replicas: %d of %d replicas acknowledged the lock", n, l.opts.SyncReplicas)
		}
		if err != nil {
			// The caller's undo releases the grant (owner-checked) at once.
			return nil, "", err
		}
	}
	return v, ans, nil
}

// replayFlag tells the acquire script to look for a stored answer.
func (l *Locker) replayFlag() string {
	if l.opts.Replay > 0 {
		return "1"
	}
	return "0"
}

// acquireReply reads the acquire script's answer: {code, n}, for a busy
// lock {0, n, held ms, other instances waiting}, and for code 2 the stored
// answer.
func acquireReply(cmd *redis.Cmd) ([]int64, string, error) {
	v, err := cmd.Slice()
	if err != nil {
		return nil, "", err
	}
	if len(v) < 2 {
		return nil, "", fmt.Errorf("redisdlm: unexpected acquire answer %v", v)
	}
	code, ok1 := v[0].(int64)
	n, ok2 := v[1].(int64)
	if !ok1 || !ok2 {
		return nil, "", fmt.Errorf("redisdlm: unexpected acquire answer %v", v)
	}
	if code == 2 && len(v) == 3 {
		if s, ok := v[2].(string); ok && s != "" {
			return []int64{code, n}, s, nil
		}
	}
	if code == 0 && len(v) == 4 {
		held, ok1 := v[2].(int64)
		others, ok2 := v[3].(int64)
		if ok1 && ok2 {
			return []int64{code, n, held, others}, "", nil
		}
	}
	return []int64{code, n}, "", nil
}

// drift is the clock-drift allowance of a Redlock lease: 1% of ttl + 2ms.
func (l *Locker) drift() time.Duration { return l.opts.TTL/100 + 2*time.Millisecond }

// raiseFences raises every key's fencing counter to fence on every server;
// each key needs a majority.
func (l *Locker) raiseFences(ctx context.Context, keys []string, fence int64) error {
	for _, k := range keys {
		res := l.callAll(ctx, func(ctx context.Context, _ int, s *Server) (any, error) {
			cctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
			defer cancel()
			return fenceRaiseScript.Run(cctx, s.client, []string{FenceKey(k)}, fence, 2*l.opts.TTL.Milliseconds()).Int64()
		}, l.majorityAnswered, nil)
		ok := 0
		for _, r := range res {
			if r.done && r.err == nil {
				ok++
			}
		}
		if ok < l.quorum {
			return fmt.Errorf("%w: fencing write-back reached %d of %d servers", ErrUnavailable, ok, len(l.servers))
		}
	}
	return nil
}

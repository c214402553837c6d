package lock

// A Locker's one acquisition attempt: the acquire script on every key
// (sorted) and every server at once, decided by a majority, with WAIT for
// sync_replicas, the undo of a partial attempt, and the fencing write-back.

import (
	"context"
	"crypto/rand"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

// newToken is a holder token: a random (version 4) UUID, made in one
// allocation (uuid.NewString takes two). From crypto/rand: a token
// releases its lock, so it is a secret (never shown, see Inspect).
func newToken() string {
	var u uuid.UUID
	_, _ = rand.Read(u[:])  // never fails: since Go 1.24 a failing source crashes the program
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 4122 variant
	return u.String()
}

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
	// runRefused: the key's run was started by another request that is
	// in doubt (*InDoubtError) or differs (ErrRunMismatch).
	runRefused error
}

// tryAcquire makes one attempt on every key (sorted) and every server.
// All keys or none: when any key is busy, the keys taken are released.
//
// first is the index of the key that was busy last time: it is asked
// first, so a request for several keys does not take and give back its free
// keys again and again while one of them stays busy.
func (l *Locker) tryAcquire(ctx context.Context, keys []string, run *Run, chain, first int) attempt {
	t := l.newTry(ctx, keys, run, chain, first)
	for i, k := range t.order {
		if a, over := t.takeKey(i, k); over {
			return a
		}
	}
	return t.finish()
}

// try is one acquisition attempt on its way: what it took, where, and
// what may still be on its way to a server.
type try struct {
	l     *Locker
	ctx   context.Context
	keys  []string // sorted
	order []string // as asked: the key that was busy last time first
	token string
	run   *Run // nil: no run record
	chain int
	start time.Time
	fence int64 // the highest counter a granting majority returned
	// A server that grants after the outcome was decided must not keep a
	// lease nobody owns: it is released there as soon as its answer comes,
	// if the attempt failed or the lease is already released — unless that
	// server's release already removed it (its grant came first there).
	failed   atomic.Bool
	released *atomic.Bool
	removed  *atomic.Uint64
	unknown  *atomic.Bool  // some server's answer was lost
	inflight *atomic.Int32 // calls not answered yet (see Lease.inflight)
	answer   atomic.Pointer[string]
	// keyUnknown[j]: some server's answer for order[j] was lost in this
	// attempt, so its undo marks the token dead for that key.
	keyUnknown []atomic.Bool
	// refused[j]: bit i is set when server i refused order[j] with an
	// answer (busy, or a call Redis refused without running it): it holds
	// nothing of this attempt there, so an undo has nothing to release on it.
	refused []uint64
	// own holds the shared records above (and, for one key, the per-key ones).
	own struct {
		released   atomic.Bool
		removed    atomic.Uint64
		unknown    atomic.Bool
		inflight   atomic.Int32
		keyUnknown [1]atomic.Bool
		refused    [1]uint64
		// Of an attempt on one key: the key's names and the acquire
		// script's keys and whole argument list, made once for every
		// server (a call's keys and arguments stay as they are until it is
		// answered, and one key is asked once per server).
		names names
		keys  [6]string
		argv  [3 + 6 + acquireArgc]any
		// The lease a successful attempt turns into (finish): it shares
		// the records above, so the try lives as long as it anyway.
		lease Lease
	}
	argv []any // the one key's acquire call (t.own.argv); nil with several keys
}

func (l *Locker) newTry(ctx context.Context, keys []string, run *Run, chain, first int) *try {
	t := &try{l: l, ctx: ctx, keys: keys, run: run, token: newToken(), chain: chain, start: l.now()}
	// What the lease shares with the attempt, and the per-key records: in
	// the try's own allocation.
	t.released, t.removed, t.unknown, t.inflight = &t.own.released, &t.own.removed, &t.own.unknown, &t.own.inflight
	if len(keys) == 1 {
		t.keyUnknown, t.refused, t.order = t.own.keyUnknown[:], t.own.refused[:], keys
		t.own.names = keyNames(keys[0])
		t.own.keys = t.own.names.acquireKeyArray()
		t.argv = t.acquireArgv(t.own.argv[:0], t.own.keys[:])
		return t
	}
	t.keyUnknown, t.refused = make([]atomic.Bool, len(keys)), make([]uint64, len(keys))
	t.order = make([]string, 0, len(keys))
	if first > 0 && first < len(keys) {
		t.order = append(t.order, keys[first])
		t.order = append(t.order, keys[:first]...)
		t.order = append(t.order, keys[first+1:]...)
	} else {
		t.order = append(t.order, keys...)
	}
	return t
}

// takeKey asks every server for order[i] at once, stopping as soon as the
// outcome is decided. over is true when the attempt ends here (not taken,
// or a stored answer); a then is its outcome.
func (t *try) takeKey(i int, k string) (a attempt, over bool) {
	l := t.l
	t.inflight.Add(int32(len(l.servers)))
	var results []result
	if len(l.servers) == 1 {
		// One server: no fan-out to decide and no late answer.
		results = []result{t.askOnly(i, k)}
	} else {
		results = l.callAll(t.ctx, func(ctx context.Context, _ int, s *Server) (any, error) {
			return t.askKey(ctx, s, i, k)
		}, func(res []result, _ int) bool {
			g, b, e := tally(res)
			n := len(res)
			return g >= l.quorum || b > n-l.quorum || e > n-l.quorum
		}, t.late(k))
	}
	for si, r := range results {
		if r.done && ((r.err == nil && r.v.([]int64)[0] != 1) || refusedUnrun(r.err)) {
			t.refused[i] |= 1 << si
		}
	}
	if a := t.answer.Load(); a != nil {
		return attempt{answer: *a}, true
	}
	if err := runRefusal(results); err != nil {
		return attempt{runRefused: err}, true
	}
	if granted, _, _ := tally(results); granted >= l.quorum {
		for _, r := range results {
			if r.done && r.err == nil && r.v.([]int64)[0] == 1 && r.v.([]int64)[1] > t.fence {
				t.fence = r.v.([]int64)[1]
			}
		}
		return attempt{}, false
	}
	return t.notTaken(i, k, results), true
}

// askKey is one server's part of takeKey: the acquire of order[i] = k,
// and what its answer tells the attempt.
func (t *try) askKey(ctx context.Context, s *Server, i int, k string) (any, error) {
	defer t.inflight.Add(-1) // after unknown is stored
	v, ans, err := t.ask(ctx, s, k)
	if unknownOutcome(err) {
		t.keyUnknown[i].Store(true)
		t.unknown.Store(true) // the lease's release marks the token dead there
	}
	if ans != "" {
		stored := ans // on the heap only when there is one
		t.answer.Store(&stored)
	}
	return v, err
}

// askOnly is askKey on the only server, a panic in it that server's error
// (as callAll makes it).
func (t *try) askOnly(i int, k string) (r result) {
	defer func() {
		if p := recover(); p != nil {
			t.l.logPanic("calling redis", p)
			r = result{err: fmt.Errorf("redisdlm: panic calling redis: %v", p), done: true}
		}
	}()
	v, err := t.askKey(t.ctx, t.l.servers[0], i, k)
	return result{v: v, err: err, done: true}
}

// ask runs the acquire script for key k on one server.
func (t *try) ask(ctx context.Context, s *Server, k string) ([]int64, string, error) {
	argv := t.argv
	if argv == nil {
		keys := keyNames(k).acquireKeyArray()
		argv = t.acquireArgv(make([]any, 0, len(t.own.argv)), keys[:])
	}
	if t.l.opts.SyncReplicas > 0 {
		return t.l.acquireSynced(ctx, s.client, argv)
	}
	// The pipe bounds the call by the server's timeout.
	return acquireReply(acquireScript.RunArgv(ctx, s.batched(), argv))
}

// late handles an answer for k that came after the outcome was decided:
// a grant is released at once if the attempt failed or the lease is gone
// already, and a lost answer (an outcome nobody knows) in the background.
func (t *try) late(k string) func(i int, r result) {
	return func(i int, r result) {
		if !t.failed.Load() && !t.released.Load() {
			return
		}
		job := t.l.releaseJob(k, t.token)
		switch {
		case r.err != nil && !refusedUnrun(r.err):
			job.unknown = unknownOutcome(r.err)
			t.l.releaseOn(i, job)
		case r.err == nil && r.v.([]int64)[0] == 1 && len(t.keys) == 1:
			// A grant that came after the release (or undo) was sent: that
			// release's answer tells whether it ran after the grant
			// (removed) or overtook it (not held); only then is a second
			// release needed. Whichever of the two comes second decides
			// (see releaseTrack).
			if prev := t.removed.Or(lateGrantBit(i)); prev&answeredBit(i) != 0 && prev&(1<<i) == 0 {
				t.l.releaseOn(i, job)
			}
		case r.err == nil && r.v.([]int64)[0] == 1:
			t.l.releaseOn(i, job)
		}
	}
}

// A lease's release record, one atomic word shared by the attempt and its
// release (try.removed, Lease.removed) for a lease of one key: bit i is set
// when server i's release removed the token, answeredBit(i) when that
// release answered without error, lateGrantBit(i) when server i's grant
// came after the outcome was decided. A late grant is released again only
// when the release answered "not held" (it overtook the grant): most late
// grants are answered before their release reaches the server, and a
// second release per request would double a Redlock member's releases.
func answeredBit(i int) uint64  { return 1 << (16 + i) }
func lateGrantBit(i int) uint64 { return 1 << (32 + i) }

// notTaken ends an attempt that did not get order[i]: it gives back what
// the attempt took, everywhere at once (this key too, where its answer was
// lost or not yet in, and with Redlock where a minority granted it), and
// says why: Redis unreachable, or busy until when.
func (t *try) notTaken(i int, k string, results []result) attempt {
	t.failed.Store(true)
	t.undo(i+1, markWhereLost)
	granted, busy, errs := tally(results)
	if granted+busy < t.l.quorum {
		// Fewer than a majority answered at all: Redis is unreachable.
		var last error
		for _, r := range results {
			if r.err != nil {
				last = r.err
			}
		}
		if t.ctx.Err() != nil {
			return attempt{err: t.ctx.Err()}
		}
		return attempt{err: fmt.Errorf("%w: %d of %d servers failed: %v", ErrUnavailable, errs, len(results), last)}
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
	for j, x := range t.keys {
		if x == k {
			busyIdx = j
		}
	}
	return attempt{retryAfter: retry, busy: facts, busyKey: busyIdx, split: granted > 0 || i > 0}
}

// deadMark says for which keys an undo marks the token dead.
type deadMark int

const (
	markWhereLost deadMark = iota // the keys whose answer was lost somewhere in the attempt
	markAll                       // every key: a minority may not have answered
)

// undo gives back order[:n] on every server that may hold it, marking the
// token dead as mark says. A server that refused a key gets
// no release of it: nothing is held there, and a release that failed there
// would count as a failure.
func (t *try) undo(n int, mark deadMark) {
	var jobs []releaseJob
	var skip []uint64
	for j, k := range t.order[:n] {
		if t.refused[j] == 1<<len(t.l.servers)-1 {
			continue
		}
		job := t.l.releaseJob(k, t.token)
		job.unknown = mark == markAll || t.keyUnknown[j].Load()
		jobs, skip = append(jobs, job), append(skip, t.refused[j])
	}
	if len(jobs) > 0 {
		t.l.runReleaseJobs(jobs, skip, t.removed)
	}
}

// finish turns an attempt that took every key into a lease: the fencing
// write-back, then the validity left (ttl − elapsed, − drift with Redlock).
func (t *try) finish() attempt {
	l, n := t.l, len(t.l.servers)
	var raise int64
	if len(t.keys) == 1 && n > 1 {
		// Redlock: the highest counter goes back to the servers with the
		// release (in the same round trip), so the majority that sees the
		// key free next also sees the counter. A holder that dies before its
		// release leaves that to the time floor of the counters: the next
		// holder comes a full ttl later, so its token is higher unless the
		// servers' clocks disagree by more than the ttl.
		raise = t.fence
	} else if len(t.keys) > 1 {
		// Several keys: one token serves them all, so each key's counter
		// must reach it before the token is used (a max-register).
		if err := l.raiseFences(t.ctx, t.keys, t.fence); err != nil {
			t.failed.Store(true)
			// A minority of servers may not have answered the acquire:
			// undone as outcomes unknown.
			t.undo(len(t.order), markAll)
			return attempt{err: err}
		}
	}
	validity := l.validity(t.start)
	if validity <= 0 {
		t.failed.Store(true)
		t.undo(len(t.order), markAll)
		return attempt{retryAfter: 0}
	}
	t.own.lease = Lease{l: l, keys: t.keys, names: t.own.names, token: t.token, fence: t.fence - int64(t.chain) + 1, start: t.start, reserved: t.start,
		until: t.start.Add(validity), released: t.released, removed: t.removed, unknown: t.unknown, inflight: t.inflight,
		chainLeft: t.chain - 1, raise: raise, run: t.run != nil}
	return attempt{lease: &t.own.lease}
}

// validity is what is left of a lease (or an extension) asked for at
// start: ttl − elapsed, and with Redlock − drift.
func (l *Locker) validity(start time.Time) time.Duration {
	v := l.opts.TTL - l.now().Sub(start)
	if len(l.servers) > 1 {
		v -= l.drift()
	}
	return v
}

// runRefusal is the refusal of a Run in an attempt's answers (replay has
// one server): its outcome in doubt (3), or another request's (4).
func runRefusal(results []result) error {
	if len(results) != 1 || !results[0].done || results[0].err != nil {
		return nil
	}
	switch v := results[0].v.([]int64); v[0] {
	case 3:
		return &InDoubtError{left: time.Duration(v[1]) * time.Millisecond}
	case 4:
		return ErrRunMismatch
	}
	return nil
}

// acquireArgc is the number of the acquire script's arguments (ARGV).
const acquireArgc = 12

// acquireArgv is the acquire call of keys (a key's acquireKeyArray),
// appended to buf (see redisconn.Script.Argv): the token goes by
// reference (no allocation to box it).
func (t *try) acquireArgv(buf []any, keys []string) []any {
	l, c := t.l, &t.l.argv
	run, fp := flagArgs[0], emptyArg
	if t.run != nil {
		run, fp = flagArgs[1], &t.run.Fingerprint
	}
	return acquireScript.Argv(buf, keys, &t.token, c.ttlMs, c.permits, c.self, c.life, t.chain, l.replayFlag(), l.turnsFlag(len(t.keys)), c.delayMs,
		run, fp, c.replayMs)
}

// emptyArg is a script's empty argument, boxed once.
var emptyArg any = ""

// acquireSynced runs the acquire script and WAIT in one pipeline on the
// key's own master (WAIT counts the replicas that have this connection's
// writes; on a Cluster it goes to the master of the key's slot, not to a
// random one). WAIT's timeout is half the call's timeout, below the read
// timeout, so too few acknowledgements are an answer, not an i/o timeout.
// A grant that too few replicas acknowledged is an error: the caller's
// undo releases it, owner-checked, at once. A stored answer (replay) grants
// nothing, so it needs no acknowledgement.
func (l *Locker) acquireSynced(ctx context.Context, c Client, argv []any) ([]int64, string, error) {
	cctx, cancel := context.WithTimeout(ctx, 2*l.opts.Timeout)
	defer cancel()
	var node Client = c
	if cc, ok := c.(masterForKey); ok {
		lockKey, _ := redisconn.Arg(argv[3])
		m, err := cc.MasterForKey(cctx, lockKey)
		if err != nil {
			return nil, "", fmt.Errorf("sync_replicas: finding the key's master: %w", err)
		}
		node = m
	}
	waitMs := max((l.opts.Timeout / 2).Milliseconds(), 1) // 0 would block for ever
	pipe := node.Pipeline()
	acq := acquireScript.EvalArgv(cctx, pipe, argv)
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
func (l *Locker) replayFlag() any { return flagArg(l.opts.Replay > 0) }

// acquireReply reads the acquire script's answer: {code, n} and, for code
// 2, the stored answer.
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

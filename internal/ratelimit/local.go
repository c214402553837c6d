package ratelimit

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
)

// The local limiter of fail_local: while Redis is unreachable, each
// instance decides on its own at its share of every rate, ceil(n ÷ N) (gcra:
// also ceil(burst ÷ N)), N being the number of instances. So that neither
// edge of an outage doubles a limit, it starts from this instance's own
// admissions of the current window (noted while Redis decides, see Note),
// and what it admits is kept to be charged to Redis once Redis answers
// again (TakeCharges, and the charge scripts).
//
// A charge is safe to send again: each carries a sequence number of this
// limiter, and the charge script keeps, per rate's key and limiter, the
// highest it applied (ChargeMarker), skipping what it already ran. So a
// charge whose answer was lost (a timeout, a dropped connection) goes back
// with Untake and is sent again, and counts once. For that, a key's
// charges reach Redis in the order of their numbers: one batch of a key is
// on its way at a time (taking skips a key whose batch is out until Done or
// Untake), and a batch given back goes before the charges made since.
//
// Per rate of a key it keeps a ring of localBuckets+1 counts over the
// rate's horizon (its window; with gcra the longer of the window and the
// burst's span): O(1) memory per key and rate, and at most max of them.
// A sliding_window rate counts every admission of a bucket that reaches
// into the window, so no interval of one window holds more than the share;
// a gcra rate replays the buckets into a theoretical arrival time at the
// share's rate, each bucket's admissions at its end (a little stricter).

const localBuckets = 16

// horizon is how far back the rate's admissions matter.
func (r LocalRate) horizon() time.Duration { return r.algo.horizon(r.Rate) }

// share is ceil(n ÷ instances), at least 1 (Share).
func share(n, instances int64) int64 {
	if instances < 1 {
		instances = 1
	}
	return max(1, (n+instances-1)/instances)
}

type localRate struct {
	rate    LocalRate
	width   time.Duration // of a bucket
	stamps  [localBuckets + 1]int64
	counts  [localBuckets + 1]int64
	charges []Charge // admitted locally, not yet charged; one per bucket
	// A batch of this key's charges is on its way to Redis (taken, not yet
	// done or given back): nothing more of the key is taken meanwhile.
	inflight bool
	last     time.Time
	gen      uint64 // when it was made: Local.gen then

	// Bumped by Recharge: a batch taken in an earlier round ends with
	// nothing to go back to (its admissions are in the new charges).
	round uint64
}

// pending reports whether e has charges to send or on their way.
func (e *localRate) pending() bool { return len(e.charges) > 0 || e.inflight }

// Local is one handler's local limiter.
type Local struct {
	mu      sync.Mutex
	max     int
	epoch   time.Time
	m       map[string]*localRate
	charged int    // entries with charges pending (to send or on their way)
	id      string // names this limiter in the charge markers
	seq     int64  // the last charge's sequence number
	gen     uint64 // the last entry made (see Reservation)
}

// newLocal makes a local limiter (NewLocal).
func newLocal(max int, epoch time.Time) *Local {
	return &Local{max: max, epoch: epoch, m: make(map[string]*localRate), id: uuid.NewString()}
}

// chargeMarker is the Redis key where the charge script keeps the highest
// sequence number of this limiter it applied to the rate's key: the
// rate's key (so the same hash slot) and the limiter's id.
func (l *Local) chargeMarker(key string) string { return key + ":charged:" + l.id }

// chargeMarkerTTL is how long a charge marker must outlive the charge it
// records: a charge is sent (again) only within its rate's horizon of its
// time, and the marker is written no earlier than that time.
func chargeMarkerTTL(r LocalRate) time.Duration { return r.horizon() + time.Minute }

// bucket is the number of the bucket of e at t.
func (l *Local) bucket(e *localRate, t time.Time) int64 {
	return int64(t.Sub(l.epoch) / e.width)
}

// entry is the state of rate r, made when missing (or kept for another
// rate of the key: a plan changed); keep are the rates of the call, which
// making room never evicts. It is nil when the map is full of entries
// whose charges still matter (see evict): the key cannot be decided here.
func (l *Local) entry(r LocalRate, now time.Time, keep []LocalRate) *localRate {
	e := l.m[r.Key]
	if e != nil && e.rate == r {
		return e
	}
	if e == nil && len(l.m) >= l.max && !l.evict(now, keep) {
		return nil
	}
	if e != nil && e.pending() {
		// Its batch on its way, if any, ends with nothing to go back to
		// (Done and Untake know their entry).
		l.charged--
	}
	l.gen++
	e = &localRate{rate: r, width: max(time.Microsecond, r.horizon()/localBuckets), last: now, gen: l.gen}
	for i := range e.stamps {
		e.stamps[i] = -1
	}
	l.m[r.Key] = e
	return e
}

// evict makes room for one entry and reports whether it did. What no
// longer matters goes first: rates whose admissions are all past their
// horizon, and charges past it (Redis would skip them); then one entry
// without charges (its noted admissions only). An entry whose charges
// still matter is never dropped (they would never reach Redis, and its key
// would start a fresh share), nor one of the calling rates keep (the call
// holds their entries): when every other entry has such charges, there is
// no room. When only the calling rates are left, the map goes over max by
// at most their number, for now.
func (l *Local) evict(now time.Time, keep []LocalRate) bool {
	kept := func(k string) bool {
		for _, r := range keep {
			if r.Key == k {
				return true
			}
		}
		return false
	}
	for k, e := range l.m {
		if kept(k) || e.inflight {
			continue
		}
		if e.pending() && !e.chargesMatter(now) {
			e.charges = nil
			l.charged--
		}
		if now.Sub(e.last) > e.rate.horizon() && !e.pending() {
			delete(l.m, k)
		}
	}
	if len(l.m) < l.max {
		return true
	}
	full := false
	for k, e := range l.m {
		switch {
		case kept(k):
		case e.pending():
			full = true
		default:
			delete(l.m, k)
			return true
		}
	}
	return !full
}

// chargesMatter reports whether any of e's charges (to send) is within
// its rate's horizon at now.
func (e *localRate) chargesMatter(now time.Time) bool {
	for _, c := range e.charges {
		if now.Sub(c.At) <= e.rate.horizon() {
			return true
		}
	}
	return false
}

// add counts cost in e's bucket of now.
func (l *Local) add(e *localRate, now time.Time, cost int64) {
	b := l.bucket(e, now)
	i := b % int64(len(e.stamps))
	if e.stamps[i] != b {
		e.stamps[i], e.counts[i] = b, 0
	}
	e.counts[i] += cost
	e.last = now
}

// note records an admission that Redis decided, of cost on every rate (a
// rate with no room left is not noted).
func (l *Local) note(rates []LocalRate, cost int64, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range rates {
		if e := l.entry(r, now, rates); e != nil {
			l.add(e, now, cost)
		}
	}
}

// confirm turns a reservation of cost into an admission Redis decided,
// noted at now (as Note), in one step: no other call sees the share
// without it in between.
func (l *Local) confirm(rates []LocalRate, cost int64, res Reservation, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.unreserve(rates, cost, res)
	for _, r := range rates {
		if e := l.entry(r, now, rates); e != nil {
			l.add(e, now, cost)
		}
	}
}

// unreserve takes res back from the entries that hold it: an entry made
// after it (the key's rate changed with a plan, or its entry was evicted
// and made again) never counted it, and keeps its counts.
func (l *Local) unreserve(rates []LocalRate, cost int64, res Reservation) {
	for _, r := range rates {
		e, ok := l.m[r.Key]
		if !ok || e.gen > res.gen {
			continue
		}
		b := l.bucket(e, res.At)
		if i := b % int64(len(e.stamps)); e.stamps[i] == b {
			e.counts[i] = max(0, e.counts[i]-cost)
		}
	}
}

// admit decides, and records an admission (with a charge to make when
// charge) and the Reservation of it.
func (l *Local) admit(rates []LocalRate, cost, instances int64, now time.Time, charge bool) (LocalDecision, Reservation) {
	l.mu.Lock()
	defer l.mu.Unlock()
	d := LocalDecision{Allowed: true, Tight: -1}
	es := make([]*localRate, len(rates))
	for i, r := range rates {
		e := l.entry(r, now, rates)
		if e == nil {
			return LocalDecision{Tight: i, Full: true}, Reservation{}
		}
		es[i] = e
		st := r.algo.admitLocally(l, e, cost, instances, now)
		ok, rem, wait, reset, share := st.ok, st.rem, st.wait, st.reset, st.share
		better := d.Tight < 0 || rem < d.Remaining || rem == d.Remaining && reset > d.Reset
		switch {
		case !ok && d.Allowed: // the first rate that rejects
			d = LocalDecision{Tight: i, Remaining: rem, Reset: reset, Wait: wait, Share: share}
		case !ok:
			if wait == 0 || d.Wait != 0 && wait > d.Wait {
				d.Wait = wait
			}
			if better {
				d.Tight, d.Remaining, d.Reset, d.Share = i, rem, reset, share
			}
		case d.Allowed && better:
			d.Tight, d.Remaining, d.Reset, d.Share = i, rem, reset, share
		}
	}
	if !d.Allowed {
		return d, Reservation{}
	}
	d.Remaining = max(0, d.Remaining-cost)
	for _, e := range es {
		l.add(e, now, cost)
		if !charge {
			continue
		}
		if n := len(e.charges); n > 0 && !e.charges[n-1].sealed && l.bucket(e, e.charges[n-1].At) == l.bucket(e, now) {
			e.charges[n-1].At, e.charges[n-1].Cost = now, e.charges[n-1].Cost+cost
			continue
		}
		if !e.pending() {
			l.charged++
		}
		// Charges older than the horizon no longer matter in Redis.
		keep := e.charges[:0]
		for _, c := range e.charges {
			if now.Sub(c.At) <= e.rate.horizon() {
				keep = append(keep, c)
			}
		}
		l.seq++
		e.charges = append(keep, Charge{At: now, Cost: cost, Seq: l.seq})
	}
	return d, Reservation{At: now, gen: l.gen}
}

// count is e's count in bucket b (0 when the ring holds another).
func (e *localRate) count(b int64) int64 {
	if b < 0 {
		return 0
	}
	i := b % int64(len(e.stamps))
	if e.stamps[i] != b {
		return 0
	}
	return e.counts[i]
}

// pending reports whether local admissions wait to be charged to Redis.
func (l *Local) pending() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.charged > 0
}

// takeCharges hands over the local admissions to charge to Redis, per
// rate's key, leaving none; those older than their rate's horizon at now are
// dropped (they no longer matter). A key whose batch is on its way already
// is left for later. Report each batch's end with Done, or give it back
// with Untake.
func (l *Local) takeCharges(now time.Time) []ChargeBatch {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []ChargeBatch
	for _, e := range l.m {
		out = l.take(e, now, out)
	}
	return out
}

// pendingFor reports whether local admissions on any of these rates' keys
// wait to be charged, or are on their way.
func (l *Local) pendingFor(rates []LocalRate) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.charged == 0 {
		return false
	}
	for _, r := range rates {
		if e := l.m[r.Key]; e != nil && e.pending() {
			return true
		}
	}
	return false
}

// takeFor is TakeCharges for these rates only; onTheirWay reports whether
// a batch of any of their keys was on its way already (taken by another
// caller, not yet Done): Redis does not know all of them yet.
func (l *Local) takeFor(rates []LocalRate, now time.Time) (out []ChargeBatch, onTheirWay bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range rates {
		if e := l.m[r.Key]; e != nil {
			onTheirWay = onTheirWay || e.inflight
			out = l.take(e, now, out)
		}
	}
	return out, onTheirWay
}

// take appends e's charges of use at now to out as one batch, on its way
// from now on, and leaves e none; nothing while a batch of e is on its way.
func (l *Local) take(e *localRate, now time.Time, out []ChargeBatch) []ChargeBatch {
	if e.inflight || len(e.charges) == 0 {
		return out
	}
	var cs []Charge
	for _, c := range e.charges {
		if now.Sub(c.At) <= e.rate.horizon() {
			c.sealed = true
			cs = append(cs, c)
		}
	}
	e.charges = nil
	if len(cs) == 0 {
		l.charged--
		return out
	}
	e.inflight = true
	return append(out, ChargeBatch{Rate: e.rate, Charges: cs, e: e, round: e.round})
}

// done ends a batch taken: Redis applied it (or refused it for good); the
// key's next charges may go.
func (l *Local) done(b ChargeBatch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := b.e
	if e == nil || l.m[b.Rate.Key] != e || !e.inflight || b.round != e.round {
		return // forgotten, replaced (an admin reset, a plan changed) or superseded (Recharge) meanwhile
	}
	e.inflight = false
	if !e.pending() {
		l.charged--
	}
}

// untake gives back a batch whose charge did not surely go through (never
// sent, or its answer lost): it goes before the key's charges made since
// (their numbers are higher), is sent again with them, and the charge
// script skips what of it already ran. A key forgotten meanwhile (an admin
// reset) or replaced (a plan changed) takes nothing back.
func (l *Local) untake(b ChargeBatch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := b.e
	if e == nil || l.m[b.Rate.Key] != e || !e.inflight || b.round != e.round {
		return
	}
	e.inflight = false
	e.charges = append(b.Charges, e.charges...)
}

// recharge makes every admission the limiter counts within its rate's
// horizon at now, those Redis decided (Note) and its own, a charge again,
// in place of the charges pending: Redis restarted empty and lost them.
// Each bucket's admissions are charged at the bucket's end (no earlier than
// they happened; at most a bucket later, which is stricter). A batch on its
// way is superseded: when it ends, it gives nothing back.
func (l *Local) recharge(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.charged = 0
	for _, e := range l.m {
		e.round++
		e.inflight, e.charges = false, nil
		cur := l.bucket(e, now)
		for b := cur - localBuckets; b <= cur; b++ {
			c := e.count(b)
			at := l.epoch.Add(time.Duration(b+1) * e.width)
			if at.After(now) {
				at = now
			}
			if c <= 0 || now.Sub(at) > e.rate.horizon() {
				continue
			}
			l.seq++
			e.charges = append(e.charges, Charge{At: at, Cost: c, Seq: l.seq})
		}
		if len(e.charges) > 0 {
			l.charged++
		}
	}
}

// forget drops the state of every rate whose key starts with prefix (an
// admin reset of a limit: its admissions no longer count, here either),
// charges included.
func (l *Local) forget(prefix string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for k, e := range l.m {
		if strings.HasPrefix(k, prefix) {
			if e.pending() {
				l.charged--
			}
			delete(l.m, k)
		}
	}
}

// charge runs the charge script of each batch (Local.Charge).
func (l *Local) charge(ctx context.Context, c redisconn.Processor, batches []ChargeBatch, o ChargeOptions) (ChargeReport, error) {
	var rep ChargeReport
	for i, b := range batches {
		args := append(b.Rate.algo.chargeArgs(b.Rate.Rate), chargeMarkerTTL(b.Rate).Milliseconds())
		for _, ch := range b.Charges {
			args = append(args, ch.At.UnixMicro()+o.Offset, ch.Cost, ch.Seq)
		}
		var superseded func() bool
		if o.Superseded != nil {
			superseded = o.Superseded()
		}
		cctx, cancel := context.WithTimeout(ctx, o.Timeout)
		err := b.Rate.algo.chargeScript().Run(cctx, c, []string{b.Rate.Key, l.chargeMarker(b.Rate.Key)}, args...).Err()
		cancel()
		if superseded != nil && superseded() {
			return rep, ErrChargeSuperseded
		}
		switch {
		case err == nil:
			l.done(b)
			rep.Rates++
			for _, ch := range b.Charges {
				rep.Cost += ch.Cost
			}
		case refusedForGood(err):
			l.done(b)
			if rep.Dropped++; rep.Dropped == 1 {
				rep.DroppedKey, rep.DroppedErr = b.Rate.Key, err
			}
		default:
			for _, rest := range batches[i:] {
				l.untake(rest)
			}
			return rep, fmt.Errorf("charging local admissions: %w", err)
		}
	}
	return rep, nil
}

// refusedForGood reports whether Redis refused a charge call in a way that
// a second send would meet again: a key of another type, or an error in the
// script itself.
func refusedForGood(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	if redisconn.RefusedForNow(msg) {
		return false
	}
	return strings.HasPrefix(msg, "WRONGTYPE") || strings.HasPrefix(msg, "CROSSSLOT") ||
		strings.Contains(msg, "user_script") || strings.Contains(msg, "Error running script")
}

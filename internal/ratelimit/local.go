package ratelimit

import (
	_ "embed"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/google/uuid"
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

var (
	//go:embed scripts/ratelimit_sliding_charge.lua
	slidingChargeLua string
	//go:embed scripts/ratelimit_gcra_charge.lua
	gcraChargeLua string

	// SlidingChargeScript and GCRAChargeScript charge one rate's key with
	// local admissions (see the scripts). They are sent alone, never in a
	// batch.
	SlidingChargeScript = redisconn.NewScript(slidingChargeLua)
	GCRAChargeScript    = redisconn.NewScript(gcraChargeLua)
)

const localBuckets = 16

// LocalRate is one rate of a limit as the local limiter takes it.
type LocalRate struct {
	Key    string // the rate's Redis key: its identity
	N      int64
	Window time.Duration
	Burst  int64 // gcra; 0 for sliding_window
}

// horizon is how far back the rate's admissions matter.
func (r LocalRate) horizon() time.Duration {
	if r.Burst > r.N {
		return time.Duration(float64(r.Window) * float64(r.Burst) / float64(r.N))
	}
	return r.Window
}

// Share is the part of n (and burst) one of instances instances enforces:
// ceil(n ÷ instances), at least 1.
func Share(n, instances int64) int64 {
	if instances < 1 {
		instances = 1
	}
	return max(1, (n+instances-1)/instances)
}

// Charge is admissions made locally in one bucket: the latest time, their
// sum of costs, and the charge's sequence number (unique in its limiter,
// ascending in a key's charges). A charge once taken is sealed: new
// admissions of its bucket make a charge of their own, since Redis may
// have applied the sealed one already.
type Charge struct {
	At     time.Time
	Cost   int64
	Seq    int64
	sealed bool
}

// ChargeBatch is what one rate's key is to be charged with.
type ChargeBatch struct {
	Rate    LocalRate
	Charges []Charge // ascending
	e       *localRate
	round   uint64 // e.round when taken
}

type localRate struct {
	rate    LocalRate
	width   time.Duration // of a bucket
	stamps  [localBuckets + 1]int64
	counts  [localBuckets + 1]int64
	charges []Charge // admitted locally, not yet charged; one per bucket
	// A batch of this key's charges is on its way to Redis (taken, not yet
	// Done or given back): nothing more of the key is taken meanwhile.
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

// NewLocal makes a local limiter of at most max rates of keys; epoch is
// any moment before the first call (bucket numbers count from it).
func NewLocal(max int, epoch time.Time) *Local {
	return &Local{max: max, epoch: epoch, m: make(map[string]*localRate), id: uuid.NewString()}
}

// ChargeMarker is the Redis key where the charge script keeps the highest
// sequence number of this limiter it applied to the rate's key: the
// rate's key (so the same hash slot) and the limiter's id.
func (l *Local) ChargeMarker(key string) string { return key + ":charged:" + l.id }

// ChargeMarkerTTL is how long a charge marker must outlive the charge it
// records: a charge is sent (again) only within its rate's horizon of its
// time, and the marker is written no earlier than that time.
func ChargeMarkerTTL(r LocalRate) time.Duration { return r.horizon() + time.Minute }

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

// Note records an admission that Redis decided, of cost on every rate (a
// rate with no room left is not noted).
func (l *Local) Note(rates []LocalRate, cost int64, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range rates {
		if e := l.entry(r, now, rates); e != nil {
			l.add(e, now, cost)
		}
	}
}

// LocalDecision is the local limiter's answer.
type LocalDecision struct {
	Allowed   bool
	Wait      time.Duration // rejected: until it would be admitted (0 = never)
	Tight     int           // the rate reported (a rejecting one when rejected)
	Remaining int64         // of rate Tight, in its share
	Reset     time.Duration // until rate Tight's share grows (0 = full)
	Share     int64         // rate Tight's share of n
	// Full: rate Tight's key has no entry, and no room for one: the
	// limiter is full of charges that still matter. Not allowed; the
	// caller decides as if it could not decide at all.
	Full bool
}

// Admit decides a request of cost on every rate, each at its share for
// instances instances, and records it when every rate admits it, as a
// local admission to be charged to Redis.
func (l *Local) Admit(rates []LocalRate, cost, instances int64, now time.Time) LocalDecision {
	d, _ := l.admit(rates, cost, instances, now, true)
	return d
}

// Reservation is a place Reserve took in the share: when, and which
// entries held it (those made by then). The zero Reservation is none.
type Reservation struct {
	At  time.Time
	gen uint64
}

// IsZero reports whether r is no reservation.
func (r Reservation) IsZero() bool { return r.At.IsZero() }

// Reserve decides a request as Admit does, and records it when every rate
// admits it as an admission Redis is about to decide (nothing to charge):
// the cap of an instance back from local mode (see the handler's
// fail_local), which also asks Redis. Unreserve takes it back when Redis
// does not admit it. The Reservation is zero when a rate rejects.
func (l *Local) Reserve(rates []LocalRate, cost, instances int64, now time.Time) (LocalDecision, Reservation) {
	return l.admit(rates, cost, instances, now, false)
}

// Unreserve takes back a reservation of cost on rates.
func (l *Local) Unreserve(rates []LocalRate, cost int64, res Reservation) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.unreserve(rates, cost, res)
}

// Confirm turns a reservation of cost into an admission Redis decided,
// noted at now (as Note), in one step: no other call sees the share
// without it in between.
func (l *Local) Confirm(rates []LocalRate, cost int64, res Reservation, now time.Time) {
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
		share := Share(r.N, instances)
		var ok bool
		var rem int64
		var wait, reset time.Duration
		if r.Burst > 0 {
			ok, rem, wait, reset = l.gcra(e, share, Share(r.Burst, instances), cost, now)
		} else {
			ok, rem, wait, reset = l.sliding(e, share, cost, now)
		}
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

// sliding decides one sliding_window rate at its share: the admissions of
// every bucket that reaches into the window count.
func (l *Local) sliding(e *localRate, share, cost int64, now time.Time) (ok bool, rem int64, wait, reset time.Duration) {
	cur := l.bucket(e, now)
	from := l.bucket(e, now.Add(-e.rate.Window))
	var used int64
	first := int64(-1)
	for b := from; b <= cur; b++ {
		if c := e.count(b); c > 0 {
			used += c
			if first < 0 {
				first = b
			}
		}
	}
	rem = max(0, share-used)
	// Bucket b leaves the window at epoch + (b+1)·width + window.
	leaves := func(b int64) time.Duration {
		return l.epoch.Add(time.Duration(b+1)*e.width + e.rate.Window).Sub(now)
	}
	if first >= 0 {
		reset = max(time.Microsecond, leaves(first))
	}
	if used+cost <= share {
		return true, rem, 0, reset
	}
	if cost > share {
		return false, rem, 0, reset // never at this share
	}
	need := used + cost - share
	for b := from; b <= cur; b++ {
		if need -= e.count(b); need <= 0 {
			return false, rem, max(time.Microsecond, leaves(b)), reset
		}
	}
	return false, rem, e.rate.Window, reset
}

// gcra decides one gcra rate at its share: a theoretical arrival time
// replayed from the buckets, one unit costing window ÷ share.
func (l *Local) gcra(e *localRate, share, burst, cost int64, now time.Time) (ok bool, rem int64, wait, reset time.Duration) {
	unit := float64(e.rate.Window) / float64(share)
	tau := float64(burst) * unit
	cur := l.bucket(e, now)
	t := float64(now.Sub(l.epoch))
	tat := 0.0
	for b := cur - localBuckets; b <= cur; b++ {
		c := e.count(b)
		if c == 0 {
			continue
		}
		at := math.Min(float64(time.Duration(b+1)*e.width), t)
		tat = math.Max(tat, at) + float64(c)*unit
	}
	tat = math.Max(tat, t)
	debt := tat - t
	rem = min(max(int64(math.Floor((tau-debt+0.5)/unit)), 0), burst)
	if rem < burst {
		reset = time.Duration(math.Max(1000, math.Ceil(debt-tau+float64(rem+1)*unit)))
	}
	if cost > burst {
		return false, rem, 0, reset
	}
	if at := tat + float64(cost)*unit - tau; at > t {
		return false, rem, time.Duration(math.Ceil(at - t)), reset
	}
	return true, rem, 0, reset
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

// Pending reports whether local admissions wait to be charged to Redis.
func (l *Local) Pending() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.charged > 0
}

// TakeCharges hands over the local admissions to charge to Redis, per
// rate's key, leaving none; those older than their rate's horizon at now are
// dropped (they no longer matter). A key whose batch is on its way already
// is left for later. Report each batch's end with Done, or give it back
// with Untake.
func (l *Local) TakeCharges(now time.Time) []ChargeBatch {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []ChargeBatch
	for _, e := range l.m {
		out = l.take(e, now, out)
	}
	return out
}

// PendingFor reports whether local admissions on any of these rates' keys
// wait to be charged, or are on their way.
func (l *Local) PendingFor(rates []LocalRate) bool {
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

// TakeFor is TakeCharges for these rates only; onTheirWay reports whether
// a batch of any of their keys was on its way already (taken by another
// caller, not yet Done): Redis does not know all of them yet.
func (l *Local) TakeFor(rates []LocalRate, now time.Time) (out []ChargeBatch, onTheirWay bool) {
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

// Done ends a batch taken: Redis applied it (or refused it for good); the
// key's next charges may go.
func (l *Local) Done(b ChargeBatch) {
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

// Untake gives back a batch whose charge did not surely go through (never
// sent, or its answer lost): it goes before the key's charges made since
// (their numbers are higher), is sent again with them, and the charge
// script skips what of it already ran. A key forgotten meanwhile (an admin
// reset) or replaced (a plan changed) takes nothing back.
func (l *Local) Untake(b ChargeBatch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := b.e
	if e == nil || l.m[b.Rate.Key] != e || !e.inflight || b.round != e.round {
		return
	}
	e.inflight = false
	e.charges = append(b.Charges, e.charges...)
}

// Recharge makes every admission the limiter counts within its rate's
// horizon at now, those Redis decided (Note) and its own, a charge again,
// in place of the charges pending: Redis restarted empty and lost them.
// Each bucket's admissions are charged at the bucket's end (no earlier than
// they happened; at most a bucket later, which is stricter). A batch on its
// way is superseded: when it ends, it gives nothing back.
func (l *Local) Recharge(now time.Time) {
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

// Forget drops the state of every rate whose key starts with prefix (an
// admin reset of a limit: its admissions no longer count, here either),
// charges included.
func (l *Local) Forget(prefix string) {
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

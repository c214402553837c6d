package ratelimit

import (
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testclock"
)

func TestShare(t *testing.T) {
	for _, c := range []struct{ n, inst, want int64 }{{20, 2, 10}, {20, 4, 5}, {20, 3, 7}, {1, 4, 1}, {5, 0, 5}, {7, 1, 7}} {
		if got := Share(c.n, c.inst); got != c.want {
			t.Errorf("Share(%d, %d) = %d, want %d", c.n, c.inst, got, c.want)
		}
	}
}

// TestLocalSlidingExact: at its share, the local sliding window admits at
// most share in any interval of one window (fake clock, requests every
// 7ms over many windows), and close to it; the instance's own admissions
// noted before count; what it admits is handed over as charges once.
func TestLocalSlidingExact(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(100, epoch)
	r := slidingRate("k:sw:20/2s", 20, 2*time.Second)
	now := epoch.Add(time.Second)
	l.Note([]LocalRate{r}, 6, now) // admitted through Redis before the outage
	var admitted []time.Time
	for i := 0; i < 2000; i++ {
		now = now.Add(7 * time.Millisecond)
		if d := l.Admit([]LocalRate{r}, 1, 2, now); d.Allowed {
			admitted = append(admitted, now)
		} else if d.Wait <= 0 || d.Share != 10 {
			t.Fatalf("rejected with wait %s share %d", d.Wait, d.Share)
		}
	}
	// The 6 noted at epoch+1s count in the first window.
	if n := countIn(admitted, epoch.Add(time.Second), 2*time.Second); n > 4 {
		t.Errorf("%d admitted in the first window after 6 noted, share 10", n)
	}
	for i := range admitted {
		if n := countIn(admitted, admitted[i], 2*time.Second); n > 10 {
			t.Fatalf("%d admitted in the window from %s, share 10", n, admitted[i].Sub(epoch))
		}
	}
	if total := len(admitted); total < 60 || total > 70 { // 14 s: 7 windows of 10
		t.Errorf("%d admitted in 14s at 10 per 2s", total)
	}
	if !l.Pending() {
		t.Fatal("no charges pending")
	}
	bs := l.TakeCharges(now)
	if len(bs) != 1 || len(l.TakeCharges(now)) != 0 {
		t.Fatalf("charges %v, then %v", bs, l.TakeCharges(now))
	}
	if l.Done(bs[0]); l.Pending() {
		t.Fatal("pending after its batch was done")
	}
	var sum int64
	for _, c := range bs[0].Charges {
		sum += c.Cost
	}
	// Only the charges within the last window are still of use.
	if want := int64(countIn(admitted, now.Add(-2*time.Second), 2*time.Second+time.Nanosecond)); sum < want || sum > want+10 {
		t.Errorf("charged %d, %d admitted in the last window", sum, want)
	}
}

func countIn(ts []time.Time, from time.Time, w time.Duration) int {
	n := 0
	for _, t := range ts {
		if !t.Before(from) && t.Before(from.Add(w)) {
			n++
		}
	}
	return n
}

// TestLocalGCRA: at its share, gcra admits the burst share at once, then
// one per window ÷ share; a cost above the burst share is never admitted.
func TestLocalGCRA(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(100, epoch)
	r := gcraRate("k:gcra", 20, 2*time.Second, 8)
	now := epoch.Add(time.Second)
	n := 0
	for i := 0; i < 10; i++ {
		if l.Admit([]LocalRate{r}, 1, 4, now).Allowed {
			n++
		}
	}
	if n != 2 { // burst 8 over 4 instances
		t.Errorf("%d admitted at once, want the burst share 2", n)
	}
	d := l.Admit([]LocalRate{r}, 1, 4, now)
	if d.Allowed || d.Wait <= 0 || d.Wait > 400*time.Millisecond+time.Millisecond {
		t.Errorf("after the burst: %+v, want a wait up to one unit (400ms)", d)
	}
	if d := l.Admit([]LocalRate{r}, 3, 4, now.Add(time.Hour)); d.Allowed || d.Wait != 0 {
		t.Errorf("cost 3 over a burst share of 2: %+v, want never", d)
	}
	// Sustained: one per 400ms.
	n = 0
	for i := 0; i < 400; i++ {
		now = now.Add(10 * time.Millisecond)
		if l.Admit([]LocalRate{r}, 1, 4, now).Allowed {
			n++
		}
	}
	if n < 9 || n > 12 { // 4 s at 5 per 2 s, plus what the burst refilled
		t.Errorf("%d admitted in 4s at a share of 5 per 2s", n)
	}
}

// TestLocalGCRAFullShareAtAnyMoment: the whole burst share is admitted at
// a moment of any sub-µs value (the last admission's TAT meets its bound
// exactly, and the doubles' rounding must not make it a rejection): 1
// noted through Redis, then 4 more of a share of 5, over many moments.
func TestLocalGCRAFullShareAtAnyMoment(t *testing.T) {
	epoch := time.Unix(1000, 0)
	r := gcraRate("k:gcra:10/1m", 10, time.Minute, 10)
	for k := 0; k < 500; k++ {
		l := NewLocal(100, epoch)
		at := epoch.Add(time.Duration(k)*977_777 + 13) // ns: fractions of a µs
		l.Note([]LocalRate{r}, 1, at)
		n := 0
		for i := 0; i < 6; i++ {
			if l.Admit([]LocalRate{r}, 1, 2, at.Add(time.Duration(i)*1_111)).Allowed {
				n++
			}
		}
		if n != 4 {
			t.Fatalf("at %v after the epoch: %d admitted locally after 1 noted, want the share 5 − 1", at.Sub(epoch), n)
		}
	}
}

// TestLocalBounded: the limiter keeps at most max rates of keys.
func TestLocalBounded(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(10, epoch)
	for i := 0; i < 100; i++ {
		l.Note([]LocalRate{slidingRate(string(rune('a'+i)), 5, time.Second)}, 1, epoch.Add(time.Duration(i)*time.Millisecond))
	}
	if len(l.m) > 10 {
		t.Errorf("%d entries, max 10", len(l.m))
	}
}

// TestLocalForget: an admin reset forgets a limit's rates (not another's).
func TestLocalForget(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(10, epoch)
	a := slidingRate("p{a}:sw:2/1m0s", 2, time.Minute)
	b := slidingRate("p{ab}:sw:2/1m0s", 2, time.Minute)
	now := epoch.Add(time.Second)
	for _, r := range []LocalRate{a, a, b, b} {
		l.Admit([]LocalRate{r}, 1, 1, now)
	}
	l.Forget("p{a}")
	if !l.Admit([]LocalRate{a}, 1, 1, now).Allowed {
		t.Error("a: still full after Forget")
	}
	if l.Admit([]LocalRate{b}, 1, 1, now).Allowed {
		t.Error("b: forgotten with a")
	}
	bs := l.TakeCharges(now)
	for _, x := range bs {
		l.Done(x)
	}
	if len(bs) != 2 || l.Pending() {
		t.Errorf("charges after Forget: %v", bs)
	}
}

// TestLocalChargesSealedWhenTaken: a charge handed over and given back
// (its call failed, perhaps after Redis ran it) keeps its sequence number,
// and admissions of its bucket after the hand-over go into a charge of
// their own, so that a charge sent again is the same charge: the charge
// script skips by sequence number what it already applied.
func TestLocalChargesSealedWhenTaken(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(100, epoch)
	r := slidingRate("k:sw:20/1m", 20, time.Minute)
	now := epoch.Add(time.Second)
	for i := 0; i < 2; i++ {
		l.Admit([]LocalRate{r}, 1, 1, now) // one bucket: one charge of 2
	}
	bs := l.TakeCharges(now)
	if len(bs) != 1 || len(bs[0].Charges) != 1 || bs[0].Charges[0].Cost != 2 {
		t.Fatalf("charges %+v, want one of cost 2", bs)
	}
	first := bs[0].Charges[0]
	l.Untake(bs[0])
	l.Admit([]LocalRate{r}, 1, 1, now) // the same bucket, after the hand-over
	bs = l.TakeCharges(now)
	if len(bs) != 1 || len(bs[0].Charges) != 2 {
		t.Fatalf("charges %+v, want the given-back one and a new one", bs)
	}
	got, added := bs[0].Charges[0], bs[0].Charges[1]
	if got.Seq != first.Seq || got.Cost != 2 || !got.At.Equal(first.At) {
		t.Errorf("given-back charge %+v, want %+v again", got, first)
	}
	if added.Seq <= got.Seq || added.Cost != 1 {
		t.Errorf("new charge %+v, want cost 1 and a later sequence number than %d", added, got.Seq)
	}
	if l.ChargeMarker(r.Key) == NewLocal(100, epoch).ChargeMarker(r.Key) || !strings.HasPrefix(l.ChargeMarker(r.Key), r.Key+":") {
		t.Errorf("charge marker %q: want the rate's key and a name of its own limiter", l.ChargeMarker(r.Key))
	}
}

// TestLocalOneBatchOfAKeyOnItsWay: a key's batch once taken is on its way
// until Done or Untake: nothing more of the key is taken meanwhile (its
// charges reach Redis in the order of their numbers), it still counts as
// pending, and a batch given back goes before the charges made since.
func TestLocalOneBatchOfAKeyOnItsWay(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(100, epoch)
	r := slidingRate("k:sw:20/1m", 20, time.Minute)
	other := slidingRate("o:sw:20/1m", 20, time.Minute)
	now := epoch.Add(time.Second)
	l.Admit([]LocalRate{r}, 1, 1, now)
	first := l.TakeCharges(now)
	if len(first) != 1 {
		t.Fatalf("charges %+v, want one batch", first)
	}
	l.Admit([]LocalRate{r}, 1, 1, now)     // made while the first is on its way
	l.Admit([]LocalRate{other}, 1, 1, now) // another key: not held up
	if !l.Pending() || !l.PendingFor([]LocalRate{r}) {
		t.Fatal("a key whose batch is on its way is not pending")
	}
	bs, onTheirWay := l.TakeFor([]LocalRate{r, other}, now)
	if !onTheirWay || len(bs) != 1 || bs[0].Rate.Key != other.Key {
		t.Fatalf("TakeFor while r's batch is on its way: %+v (on their way %v), want only the other key's", bs, onTheirWay)
	}
	l.Done(bs[0])
	l.Untake(first[0]) // its answer was lost
	bs = l.TakeCharges(now)
	if len(bs) != 1 || len(bs[0].Charges) != 2 || bs[0].Charges[0].Seq != first[0].Charges[0].Seq || bs[0].Charges[1].Seq <= bs[0].Charges[0].Seq {
		t.Fatalf("after the batch came back: %+v, want it first, then the newer charge", bs)
	}
	l.Done(bs[0])
	if l.Pending() {
		t.Error("pending after every batch was done")
	}
}

// TestLocalFullMapKeepsCallersRates: with the map full, making room for a
// request's second rate never evicts its first (made in the same call),
// so every admission's charge stays findable and Pending ends.
func TestLocalFullMapKeepsCallersRates(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(1, epoch)
	a := slidingRate("k:sw:5/1m", 5, time.Minute)
	b := slidingRate("k:sw:50/1h", 50, time.Hour)
	now := epoch.Add(time.Second)
	if !l.Admit([]LocalRate{a, b}, 1, 1, now).Allowed {
		t.Fatal("first request rejected")
	}
	bs := l.TakeCharges(now)
	if len(bs) != 2 {
		t.Fatalf("charges %+v, want one batch per rate", bs)
	}
	for _, x := range bs {
		l.Done(x)
	}
	doneAll(t, l, now)

	// A rate of the request whose entry is stale (its admissions no longer
	// matter) is not dropped to make room for the request's next rate.
	l = NewLocal(1, epoch)
	short := slidingRate("k:sw:5/1s", 5, time.Second)
	l.Note([]LocalRate{short}, 1, now)
	later := now.Add(time.Minute)
	if !l.Admit([]LocalRate{short, b}, 1, 1, later).Allowed {
		t.Fatal("request with a stale rate rejected")
	}
	if bs := l.TakeCharges(later); len(bs) != 2 {
		t.Fatalf("charges %+v, want one batch per rate", bs)
	} else {
		for _, x := range bs {
			l.Done(x)
		}
	}
	doneAll(t, l, later)
}

// TestLocalBatchOnItsWayNotEvicted: a key whose batch is on its way is not
// evicted to make room, so that the key's next charges wait for it: two
// batches of one key are never on their way at once.
func TestLocalBatchOnItsWayNotEvicted(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(1, epoch)
	a := slidingRate("a:sw:5/1m", 5, time.Minute)
	b := slidingRate("b:sw:5/1m", 5, time.Minute)
	now := epoch.Add(time.Second)
	l.Admit([]LocalRate{a}, 1, 1, now)
	first := l.TakeCharges(now)
	l.Admit([]LocalRate{b}, 1, 1, now) // the map is full: a is on its way
	l.Admit([]LocalRate{a}, 1, 1, now)
	bs, onTheirWay := l.TakeFor([]LocalRate{a}, now)
	if !onTheirWay || len(bs) != 0 {
		t.Fatalf("TakeFor(a) while a's batch is on its way: %+v (on their way %v), want nothing, on its way", bs, onTheirWay)
	}
	l.Done(first[0])
	doneAll(t, l, now)
}

// TestLocalReplacedEntryIgnoresOldBatch: a key whose rate changed (a plan
// changed) starts a new entry; the old entry's batch, when it ends, leaves
// the new one's batch on its way.
func TestLocalReplacedEntryIgnoresOldBatch(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(10, epoch)
	old := slidingRate("k:sw", 5, time.Minute)
	cur := slidingRate("k:sw", 6, time.Minute)
	now := epoch.Add(time.Second)
	l.Admit([]LocalRate{old}, 1, 1, now)
	b1 := l.TakeCharges(now)
	l.Admit([]LocalRate{cur}, 1, 1, now)
	b2 := l.TakeCharges(now)
	if len(b1) != 1 || len(b2) != 1 {
		t.Fatalf("batches %+v %+v, want one each", b1, b2)
	}
	l.Done(b1[0])
	l.Untake(b1[0])
	l.Admit([]LocalRate{cur}, 1, 1, now)
	if bs, onTheirWay := l.TakeFor([]LocalRate{cur}, now); !onTheirWay || len(bs) != 0 {
		t.Fatalf("after the old entry's batch ended: %+v (on their way %v), want the new one's still on its way", bs, onTheirWay)
	}
	l.Done(b2[0])
	doneAll(t, l, now)
}

// doneAll takes what is left to charge, ends every batch as applied, and
// checks that nothing is pending then.
func doneAll(t *testing.T, l *Local, now time.Time) {
	t.Helper()
	for _, x := range l.TakeCharges(now) {
		l.Done(x)
	}
	if l.Pending() {
		t.Error("pending after every batch was done")
	}
}

// TestLocalReserve: a reservation takes its place in the share at once,
// makes no charge, and is given back (Unreserve) or becomes an admission
// noted when Redis's answer came (Confirm), for both algorithms.
func TestLocalReserve(t *testing.T) {
	for _, c := range []struct {
		r LocalRate
		// A moment when the share is free if the two admissions count from
		// their reservation, but not from their answer 300 ms later.
		check time.Duration
	}{
		{slidingRate("k:sw", 4, time.Second), time.Second + 100*time.Millisecond},
		// gcra at a share of 2/s (burst 2): the two put the arrival time
		// 1 s on, and a request passes within 500 ms of it.
		{gcraRate("k:gcra", 4, time.Second, 4), 700 * time.Millisecond},
	} {
		r := c.r
		epoch := time.Unix(1000, 0)
		l := NewLocal(100, epoch)
		rates := []LocalRate{r}
		at := epoch.Add(time.Second)
		reserve := func() (bool, Reservation) {
			d, res := l.Reserve(rates, 1, 2, at)
			if d.Allowed == res.IsZero() {
				t.Errorf("%s: reservation %+v for a decision allowed %v", r.Key, res, d.Allowed)
			}
			return d.Allowed, res
		}
		// instances 2: a share of 2.
		ok1, res1 := reserve()
		ok2, res2 := reserve()
		if !ok1 || !ok2 {
			t.Fatalf("%s: the share's two reservations refused", r.Key)
		}
		if ok, _ := reserve(); ok {
			t.Errorf("%s: a third reservation within a share of 2", r.Key)
		}
		if l.Pending() {
			t.Errorf("%s: reservations made charges", r.Key)
		}
		l.Unreserve(rates, 1, res2)
		ok3, res3 := reserve()
		if !ok3 {
			t.Errorf("%s: the place given back is not free", r.Key)
		}
		// Both confirmed 300 ms after they were reserved: they fill the
		// share until a window after that, not after the reservation.
		got := at.Add(300 * time.Millisecond)
		l.Confirm(rates, 1, res1, got)
		l.Confirm(rates, 1, res3, got)
		if d := l.Admit(rates, 1, 2, at.Add(c.check)); d.Allowed {
			t.Errorf("%s: admitted %v after the reservations: counted from them, not from the answers", r.Key, c.check)
		}
		if l.Pending() {
			t.Errorf("%s: confirmed reservations made charges", r.Key)
		}
	}
}

// TestLocalUnreserveMadeAfter: a reservation given back after its key's
// entry was made again (evicted to make room, or its rate changed with a
// plan) is not taken from the new entry, which never counted it: the new
// entry's own admissions still fill the share.
func TestLocalUnreserveMadeAfter(t *testing.T) {
	epoch := time.Unix(1000, 0)
	r := slidingRate("k", 2, time.Second)
	at := epoch.Add(time.Second)
	for _, c := range []struct {
		name    string
		remake  func(l *Local)
		current LocalRate // the key's rate after remake
	}{
		{"evicted", func(l *Local) {
			// max 1: another key's entry evicts k's.
			l.Note([]LocalRate{slidingRate("other", 2, time.Second)}, 1, at)
			if _, ok := l.m["k"]; ok {
				t.Fatal("k's entry not evicted")
			}
		}, r},
		{"plan changed", func(*Local) {}, slidingRate("k", 2, 2*time.Second)},
	} {
		l := NewLocal(1, epoch)
		d, res := l.Reserve([]LocalRate{r}, 1, 1, at)
		if !d.Allowed {
			t.Fatalf("%s: reservation refused", c.name)
		}
		c.remake(l)
		cur := []LocalRate{c.current}
		// The new entry: two admissions Redis decided fill the share of 2.
		l.Note(cur, 1, at)
		l.Note(cur, 1, at)
		if _, ok := l.m["k"]; !ok || l.m["k"].gen <= res.gen {
			t.Fatalf("%s: k's entry not made after the reservation", c.name)
		}
		l.Unreserve([]LocalRate{r}, 1, res)
		if d := l.Admit(cur, 1, 1, at); d.Allowed {
			t.Errorf("%s: a third admission passed a share of 2: the old reservation was taken from the new entry", c.name)
		}
	}
}

// TestLocalConfirmMadeAfter: a reservation confirmed after its key's entry
// was evicted and made again adds its admission to the new entry without
// taking anything off it; and of a request's rates, those whose entry
// still holds the reservation give it back while a remade one (its plan
// changed) keeps its counts.
func TestLocalConfirmMadeAfter(t *testing.T) {
	epoch := time.Unix(1000, 0)
	at := epoch.Add(time.Second)
	r := slidingRate("k", 2, time.Second)
	changed := slidingRate("k", 2, 2*time.Second)

	// max 1: another key's entry evicts k's, then k's is made again.
	l := NewLocal(1, epoch)
	_, res := l.Reserve([]LocalRate{r}, 1, 1, at)
	l.Note([]LocalRate{slidingRate("x", 2, time.Second)}, 1, at)
	l.Note([]LocalRate{r}, 1, at) // k's new entry, one admission
	l.Confirm([]LocalRate{r}, 1, res, at)
	if d := l.Admit([]LocalRate{r}, 1, 1, at); d.Allowed {
		t.Error("confirm: a third admission passed a share of 2: the reservation was taken off the new entry")
	}

	l = NewLocal(10, epoch)
	other := slidingRate("o", 1, time.Second)
	d, res := l.Reserve([]LocalRate{r, other}, 1, 1, at)
	if !d.Allowed {
		t.Fatal("reservation on two rates refused")
	}
	l.Note([]LocalRate{changed}, 1, at)
	l.Note([]LocalRate{changed}, 1, at) // k's new entry: full
	l.Unreserve([]LocalRate{r, other}, 1, res)
	if d := l.Admit([]LocalRate{other}, 1, 1, at); !d.Allowed {
		t.Error("the rate whose entry held the reservation did not get its place back")
	}
	if d := l.Admit([]LocalRate{changed}, 1, 1, at); d.Allowed {
		t.Error("the remade entry lost an admission to the reservation it never held")
	}
}

// TestLocalFullOfChargesRefusesNewKey: when every entry
// holds local admissions still to charge that still matter, a new key
// finds no room: it is refused as Full (the handler answers as
// fail_closed), and no charge is dropped. Charges past their rate's
// horizon no longer matter: they go to make room, and so does an entry
// that only notes what Redis decided.
func TestLocalFullOfChargesRefusesNewKey(t *testing.T) {
	clock := testclock.New()
	l := NewLocal(3, clock.Now())
	rate := func(k string) []LocalRate { return []LocalRate{slidingRate(k, 10, 10*time.Second)} }
	clock.Advance(time.Second)
	for _, k := range []string{"a", "b", "c"} {
		if !l.Admit(rate(k), 2, 1, clock.Now()).Allowed {
			t.Fatalf("%s: not admitted", k)
		}
	}
	clock.Advance(time.Second)
	if d := l.Admit(rate("d"), 1, 1, clock.Now()); d.Allowed || !d.Full {
		t.Errorf("a new key in a map full of charges that matter: %+v, want Full and not allowed", d)
	}
	l.Note(rate("d"), 1, clock.Now()) // Redis decided it: no room to note it either, and no panic
	var sum int64
	bs := l.TakeCharges(clock.Now())
	for _, b := range bs {
		for _, c := range b.Charges {
			sum += c.Cost
		}
		l.Done(b)
	}
	if len(bs) != 3 || sum != 6 {
		t.Errorf("charges of %d keys, cost %d, want all 3 keys' 6 (none dropped)", len(bs), sum)
	}

	// Charged now, they are noted admissions only: one goes for a new key.
	if d := l.Admit(rate("d"), 1, 1, clock.Now()); !d.Allowed {
		t.Errorf("a new key where entries only note admissions: %+v, want allowed", d)
	}
	// Charges past the window no longer matter: they make room.
	l = NewLocal(2, clock.Now())
	for _, k := range []string{"a", "b"} {
		l.Admit(rate(k), 1, 1, clock.Now())
	}
	clock.Advance(11 * time.Second)
	if d := l.Admit(rate("c"), 1, 1, clock.Now()); !d.Allowed {
		t.Errorf("a new key where every charge is past its window: %+v, want allowed", d)
	}
	if bs := l.TakeCharges(clock.Now()); len(bs) != 1 || bs[0].Rate.Key != "c" {
		t.Errorf("charges %+v, want only c's", bs)
	}
}

// TestLocalRecharge: after Redis restarted empty, every admission of the
// current windows this limiter counts, those Redis decided (noted) and its
// own, becomes a charge again, once, never stamped before it happened;
// admissions past the window are not; a batch that was on its way is
// superseded (its end gives nothing back); new admissions are charged
// after.
func TestLocalRecharge(t *testing.T) {
	clock := testclock.New()
	l := NewLocal(10, clock.Now())
	r := []LocalRate{slidingRate("k", 100, 10*time.Second)}
	l.Note(r, 4, clock.Now()) // leaves the window before the restart
	clock.Advance(5 * time.Second)
	noted := clock.Now()
	l.Note(r, 3, noted)
	clock.Advance(time.Second)
	local := clock.Now()
	l.Admit(r, 2, 1, local)
	onItsWay := l.TakeCharges(local)
	clock.Advance(5 * time.Second)
	restart := clock.Now()
	l.Recharge(restart)
	l.Untake(onItsWay[0]) // superseded: nothing goes back
	l.Admit(r, 1, 1, restart)
	bs := l.TakeCharges(restart)
	if len(bs) != 1 {
		t.Fatalf("batches %+v, want one", bs)
	}
	var cost int64
	for i, c := range bs[0].Charges {
		cost += c.Cost
		if i > 0 && c.Seq <= bs[0].Charges[i-1].Seq {
			t.Errorf("charge %d: sequence %d after %d", i, c.Seq, bs[0].Charges[i-1].Seq)
		}
	}
	if cost != 3+2+1 {
		t.Errorf("recharged %d, want the 3 noted and 2 local admissions of the window, and the 1 since (%+v)", cost, bs[0].Charges)
	}
	if first := bs[0].Charges[0]; first.At.Before(noted) || first.At.After(noted.Add(time.Second)) {
		t.Errorf("the noted admissions charged at %v, want at %v or up to a bucket later", first.At.Sub(noted), noted)
	}
	l.Done(onItsWay[0]) // superseded: leaves the new batch on its way
	if !l.PendingFor(r) {
		t.Error("the recharge batch is no longer on its way after the old batch's end")
	}
	l.Done(bs[0])
	if l.Pending() {
		t.Error("pending after the recharge batch was done")
	}
}

// slidingRate is a sliding_window rate of n per window under key.
func slidingRate(key string, n int64, window time.Duration) LocalRate {
	return LocalRate{Key: key, Rate: Rate{N: n, Window: window}, algo: SlidingWindow}
}

// gcraRate is a gcra rate of n per window and burst under key.
func gcraRate(key string, n int64, window time.Duration, burst int64) LocalRate {
	return LocalRate{Key: key, Rate: Rate{N: n, Window: window, Burst: burst}, algo: GCRA}
}

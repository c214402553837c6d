package ratelimit

import (
	"testing"
	"time"
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
	r := LocalRate{Key: "k:sw:20/2s", N: 20, Window: 2 * time.Second}
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
	if len(bs) != 1 || l.Pending() {
		t.Fatalf("charges %v, pending %v", bs, l.Pending())
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
	r := LocalRate{Key: "k:gcra", N: 20, Window: 2 * time.Second, Burst: 8}
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

// TestLocalBounded: the limiter keeps at most max rates of keys.
func TestLocalBounded(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(10, epoch)
	for i := 0; i < 100; i++ {
		l.Note([]LocalRate{{Key: string(rune('a' + i)), N: 5, Window: time.Second}}, 1, epoch.Add(time.Duration(i)*time.Millisecond))
	}
	if len(l.m) > 10 {
		t.Errorf("%d entries, max 10", len(l.m))
	}
}

// TestLocalForget: an admin reset forgets a limit's rates (not another's).
func TestLocalForget(t *testing.T) {
	epoch := time.Unix(1000, 0)
	l := NewLocal(10, epoch)
	a := LocalRate{Key: "p{a}:sw:2/1m0s", N: 2, Window: time.Minute}
	b := LocalRate{Key: "p{ab}:sw:2/1m0s", N: 2, Window: time.Minute}
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
	if bs := l.TakeCharges(now); len(bs) != 2 || l.Pending() {
		t.Errorf("charges after Forget: %v", bs)
	}
}

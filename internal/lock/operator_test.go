package lock

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestInspect: a key's state on every server — none before any use; one
// holder with its lease left and the fencing counter; the instances on its
// wait list, this one among them; never a holder's token.
func TestInspect(t *testing.T) {
	onOneAndThreeServers(t, func(t *testing.T, rs []*testredis.Server) {
		o := testOptions()
		o.TTL, o.Wait = 5*time.Second, 20*time.Second
		a, _ := testLocker(t, rs, o)
		b, _ := testInstance(t, "b", rs, o)
		ctx := context.Background()
		const key = "caddy:lock:{inspect}"
		for i, st := range a.Inspect(ctx, key) {
			if st.Err != nil || len(st.LeaseLeft) != 0 || st.Fence != nil || st.InstancesWaiting != 0 || st.ThisInstanceWaiting || st.Stored != nil || st.InDoubt {
				t.Fatalf("server %d before any use: %+v, want nothing", i, st)
			}
		}
		ls, err := b.Acquire(ctx, []string{key})
		if err != nil {
			t.Fatal(err)
		}
		// A Redlock grant decides on a majority: the third server's acquire
		// may still be on its way. Were the waiter's acquire to reach that
		// server first, the holder's late one would find it busy and put
		// the holder's instance on its wait list, rightly.
		if !waitFor(10*time.Second, func() bool {
			for _, st := range a.Inspect(ctx, key) {
				if len(st.LeaseLeft) != 1 {
					return false
				}
			}
			return true
		}) {
			t.Fatal("the holder's lease never reached every server")
		}
		waited := make(chan error, 1)
		go func() {
			ls, err := a.Acquire(ctx, []string{key})
			if err == nil {
				ls.Release()
			}
			waited <- err
		}()
		if !waitFor(10*time.Second, func() bool { return onWaitList(rs, key, a.InstanceID()) }) {
			t.Fatal("the waiter never got on the wait list")
		}
		states := a.Inspect(ctx, key)
		if len(states) != len(rs) {
			t.Fatalf("%d states for %d servers", len(states), len(rs))
		}
		waiting, atToken := 0, 0
		for i, st := range states {
			if st.Err != nil || len(st.LeaseLeft) != 1 || st.LeaseLeft[0] <= 0 || st.LeaseLeft[0] > o.TTL {
				t.Errorf("server %d with a holder: %+v, want one lease of (0, %s] left", i, st, o.TTL)
			}
			// Each server keeps its own counter, reserved ahead in blocks;
			// the lease's token is below the highest of a majority.
			if st.Fence == nil || *st.Fence < 1 {
				t.Errorf("server %d: fencing counter %v, want at least 1", i, st.Fence)
			} else if *st.Fence >= ls.Fence() {
				atToken++
			}
			if st.ThisInstanceWaiting {
				waiting++
				if st.InstancesWaiting != 1 {
					t.Errorf("server %d: %d instances waiting, want 1", i, st.InstancesWaiting)
				}
			}
		}
		if waiting == 0 {
			t.Error("no server shows this instance waiting")
		}
		if atToken == 0 {
			t.Errorf("no server's fencing counter reaches the holder's token %d", ls.Fence())
		}
		for i, st := range b.Inspect(ctx, key) {
			if st.ThisInstanceWaiting {
				t.Errorf("server %d shows the holder's instance waiting", i)
			}
		}
		ls.Release()
		if err := <-waited; err != nil {
			t.Fatalf("the waiter after the release: %v", err)
		}
	})
}

// TestInspectStored: a run record is shown as its format alone ("run1",
// never its token) and as in doubt once its lease is gone; a stored answer
// by its type, size, expiry and first bytes; a value of another type by
// its type.
func TestInspectStored(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	l := runLocker(t, r, 300*time.Millisecond)
	ctx := context.Background()
	const key = "caddy:lock:{stored}"
	ls, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "fp"})
	if err != nil {
		t.Fatal(err)
	}
	record := replayValue(t, r, key)
	st := l.Inspect(ctx, key)[0]
	if s := st.Stored; st.Err != nil || s == nil || !s.Run || s.Head != "run1" || s.Type != "string" || st.InDoubt {
		t.Fatalf("a live run: %+v %+v, want a run record, not in doubt", st, s)
	}
	token := strings.Split(record, "\n")[1]
	if strings.Contains(st.Stored.Head, token) {
		t.Fatalf("Inspect shows the holder's token: %q", st.Stored.Head)
	}
	if !waitFor(5*time.Second, func() bool { return l.Inspect(ctx, key)[0].InDoubt }) {
		t.Fatal("a run record whose lease ran out is not in doubt")
	}
	answer := "rdlm1\n{\"status\":200}\n" + strings.Repeat("b", 10000)
	if stored, err := ls.KeepAnswer(ctx, answer); err != nil || !stored {
		t.Fatalf("KeepAnswer: %v %v", stored, err)
	}
	ls.Release()
	st = l.Inspect(ctx, key)[0]
	if s := st.Stored; s == nil || s.Run || st.InDoubt || s.Type != "string" || s.Size != int64(len(answer)) || s.Head != answer[:storedHeadMax] {
		t.Fatalf("a stored answer: %+v, want its size %d and first %d bytes", s, len(answer), storedHeadMax)
	}
	if st.Stored.TTL <= 0 || st.Stored.TTL > time.Minute {
		t.Errorf("a stored answer expires in %s, want within the replay window (1m)", st.Stored.TTL)
	}
	r.Client().HSet(ctx, ReplayKey("caddy:lock:{odd}"), "x", "y")
	if s := l.Inspect(ctx, "caddy:lock:{odd}")[0].Stored; s == nil || s.Type != "hash" || s.Size != 0 || s.Head != "" || s.Run || s.TTL >= 0 {
		t.Errorf("a hash under the replay key: %+v, want its type, no expiry", s)
	}
}

// TestForceRelease: every holder is removed on every server and counted;
// the old holder's extension finds its lease lost; a waiter of another
// instance gets the key at once (woken, not polling); with lock_delay
// nobody gets it for the delay; a key not held removes nothing.
func TestForceRelease(t *testing.T) {
	onOneAndThreeServers(t, func(t *testing.T, rs []*testredis.Server) {
		o := testOptions()
		o.TTL, o.Wait, o.BackoffMin, o.BackoffMax = 30*time.Second, 20*time.Second, 10*time.Second, 10*time.Second
		a, _ := testLocker(t, rs, o)
		b, _ := testInstance(t, "b", rs, o)
		ctx := context.Background()
		const key = "caddy:lock:{forced}"
		for i, r := range a.ForceRelease(ctx, key) {
			if r.Err != nil || r.Count != 0 {
				t.Fatalf("server %d, a key never held: %+v, want 0 removed", i, r)
			}
		}
		ls, err := a.Acquire(ctx, []string{key})
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan time.Time, 1)
		go func() {
			ls, err := b.Acquire(ctx, []string{key})
			if err != nil {
				t.Errorf("the waiter: %v", err)
				close(got)
				return
			}
			got <- time.Now()
			ls.Release()
		}()
		if !waitFor(10*time.Second, func() bool { return onWaitList(rs, key, b.InstanceID()) }) {
			t.Fatal("the waiter never got on the wait list")
		}
		forced := time.Now()
		for i, r := range a.ForceRelease(ctx, key) {
			if r.Err != nil || r.Count != 1 {
				t.Errorf("server %d: %+v, want 1 holder removed", i, r)
			}
		}
		select {
		case at, ok := <-got:
			if ok && at.Sub(forced) > 5*time.Second {
				t.Errorf("the waiter got the key %s after the force release, want it woken (its backoff is 10s)", at.Sub(forced))
			}
		case <-time.After(15 * time.Second):
			t.Fatal("the waiter never got the key after the force release")
		}
		if err := a.Extend(ctx, ls); !errors.Is(err, ErrLeaseLost) {
			t.Errorf("extending a force-released lease: %v, want ErrLeaseLost", err)
		}
		ls.Release()
	})
	t.Run("lock_delay", func(t *testing.T) {
		t.Parallel()
		rs := startServers(t, 1)
		o := testOptions()
		o.LockDelay = 2 * time.Second
		l, _ := testLocker(t, rs, o)
		ctx := context.Background()
		const key = "caddy:lock:{delayed}"
		ls, err := l.Acquire(ctx, []string{key})
		if err != nil {
			t.Fatal(err)
		}
		defer ls.Release()
		if r := l.ForceRelease(ctx, key)[0]; r.Err != nil || r.Count != 1 {
			t.Fatalf("force release: %+v", r)
		}
		if ttl := rs[0].Client().PTTL(ctx, DelayKey(key)).Val(); ttl <= 0 || ttl > o.LockDelay {
			t.Errorf("the delay key expires in %s, want within lock_delay (%s)", ttl, o.LockDelay)
		}
		var busy *BusyError
		if _, err := l.Acquire(ctx, []string{key}); !errors.As(err, &busy) {
			t.Errorf("an acquire within lock_delay of a force release: %v, want busy", err)
		}
	})
}

// TestClearReplay: a run record in doubt is deleted on every server (a
// duplicate then runs), and a key with nothing stored deletes nothing.
func TestClearReplay(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	l := runLocker(t, r, 30*time.Second)
	ctx := context.Background()
	const key = "caddy:lock:{clear}"
	if res := l.ClearReplay(ctx, key); res[0].Err != nil || res[0].Count != 0 {
		t.Fatalf("nothing stored: %+v, want 0 deleted", res)
	}
	ls, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "f"})
	if err != nil {
		t.Fatal(err)
	}
	ls.Release() // without an answer: in doubt
	if !waitFor(5*time.Second, func() bool { return l.Inspect(ctx, key)[0].InDoubt }) {
		t.Fatal("the run released without an answer is not in doubt")
	}
	if res := l.ClearReplay(ctx, key); res[0].Err != nil || res[0].Count != 1 {
		t.Fatalf("clearing the run record: %+v, want 1 deleted", res)
	}
	if v := replayValue(t, r, key); v != "" {
		t.Fatalf("replay key after ClearReplay = %q", v)
	}
	again, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "f"})
	if err != nil {
		t.Fatalf("a duplicate after ClearReplay: %v, want the lock", err)
	}
	again.ClearRun()
	again.Release()
}

// TestOperatorCallsRecoverPanic: a panic in one server's call of Inspect,
// ForceRelease or ClearReplay is that server's error; the others answer
// and the process lives on.
func TestOperatorCallsRecoverPanic(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	l, fcs := testLocker(t, rs, testOptions())
	ctx := context.Background()
	const key = "caddy:lock:{panic}"
	ls, err := l.Acquire(ctx, []string{key})
	if err != nil {
		t.Fatal(err)
	}
	defer ls.Release()
	fcs[1].setHook(func(redis.Cmder, func() error) error { panic("hooked command exploded") })
	states := l.Inspect(ctx, key)
	for i, st := range states {
		if (i == 1) != (st.Err != nil) {
			t.Errorf("Inspect, server %d: %+v; want an error on server 1 only", i, st)
		}
		if i != 1 && len(st.LeaseLeft) != 1 {
			t.Errorf("Inspect, server %d: %d holders, want 1", i, len(st.LeaseLeft))
		}
	}
	for name, call := range map[string]func(context.Context, string) []Removal{"ForceRelease": l.ForceRelease, "ClearReplay": l.ClearReplay} {
		for i, r := range call(ctx, key) {
			if (i == 1) != (r.Err != nil) {
				t.Errorf("%s, server %d: %+v; want an error on server 1 only", name, i, r)
			}
		}
	}
}

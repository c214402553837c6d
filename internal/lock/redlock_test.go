package lock

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestQuorumFanOutRecoversPanic: a panic in one server's call of a Redlock
// fan-out is logged with its stack and counts as that server failing; the
// lock still works on the majority and the process lives on.
func TestQuorumFanOutRecoversPanic(t *testing.T) {
	t.Parallel()
	o := testOptions()
	o.Wait = 2 * time.Second
	l, fcs := testLocker(t, startServers(t, 3), o)
	logs := &logRecorder{}
	l.SetLogger(slog.New(logs))
	fcs[1].setHook(func(redis.Cmder, func() error) error { panic("hooked command exploded") })
	keys := []string{"caddy:lock:{/panic}"}
	for i := 0; i < 3; i++ {
		ls, err := l.Acquire(context.Background(), keys)
		if err != nil {
			t.Fatalf("acquire %d with one server panicking: %v", i, err)
		}
		ls.Release()
	}
	recs := logs.matching("panic")
	if len(recs) == 0 {
		t.Fatal("the panics were not logged")
	}
	if recs[0].attrs["stack"] == "" || recs[0].attrs["stack"] == nil {
		t.Fatalf("the panic is logged without its stack: %v", recs[0].attrs)
	}
}

// onWaitList reports whether instance id is on key's wait list on one of rs.
func onWaitList(rs []*testredis.Server, key, id string) bool {
	for _, r := range rs {
		if r.Client().ZScore(context.Background(), WaitqKey(key), id).Err() == nil {
			return true
		}
	}
	return false
}

// TestRedlockSplitWaiterStillWoken: a waiter whose attempt took part of a
// Redlock (here a member lost the holder's key, as after a restart empty;
// in traffic, a release half done) gives that part back and still wakes on
// the release: it does not sleep out its backoff (15s here) with the lock
// free.
func TestRedlockSplitWaiterStillWoken(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	o := testOptions()
	o.Wait = 20 * time.Second
	a, _ := testLocker(t, rs, o)
	o.BackoffMin, o.BackoffMax = 15*time.Second, 15*time.Second
	b, _ := testInstance(t, "b", rs, o)
	ctx := context.Background()
	key := "caddy:lock:{/split}"
	ls, err := a.Acquire(ctx, []string{key})
	if err != nil {
		t.Fatal(err)
	}
	// The majority's answers decided; wait for the third, so the key
	// deleted below stays deleted.
	if !waitFor(5*time.Second, func() bool { return heldBy(rs[0], key) == 1 }) {
		t.Fatal("the holder's lease never reached the third member")
	}
	if err := rs[0].Client().Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		ls  *Lease
		err error
	}
	waiter := make(chan outcome, 1)
	go func() {
		ls, err := b.Acquire(ctx, []string{key})
		waiter <- outcome{ls, err}
	}()
	// b took rs[0], gave it back, and waits: its instance is on a wait list.
	if !waitFor(15*time.Second, func() bool { return onWaitList(rs, key, b.InstanceID()) }) {
		t.Fatal("the split waiter never joined a wait list")
	}
	// Its attempts in between may hold rs[0] a moment.
	if !allFree(3*time.Second, key, rs[:1]) {
		t.Errorf("the split waiter kept its part of the lock on the member that lost the key (%d holders)", heldBy(rs[0], key))
	}
	start := time.Now()
	ls.Release()
	select {
	case w := <-waiter:
		if w.err != nil {
			t.Fatalf("split waiter: %v", w.err)
		}
		w.ls.Release()
	case <-time.After(20 * time.Second):
		t.Fatal("split waiter: no lease within 20s of the release")
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("the split waiter got the lock %s after the release; its backoff is 15s, so it ignored the wake-up", el)
	}
}

// TestRedlockOneReleasePerServer: a Redlock member whose grant comes after
// the majority decided (the usual case for one member: the fan-out's calls
// leave one after the other) gets one release per lease, not a second one
// for its late grant, unless that release overtook the grant (answered
// "not held"): then it is released again (TestNoOrphanOnRedlockMinority).
func TestRedlockOneReleasePerServer(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	o := testOptions()
	o.Timeout = 2 * time.Second
	l, fcs := testLocker(t, rs, o)
	var releases [3]atomic.Int64
	for i, fc := range fcs {
		fc.setHook(func(cmd redis.Cmder, next func() error) error {
			if s, _ := scriptCall(cmd); s == releaseScript {
				releases[i].Add(1)
			}
			return next()
		})
	}
	const workers, each = 16, 20
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < each; i++ {
				ls, err := l.Acquire(context.Background(), []string{fmt.Sprintf("caddy:lock:{one-%d-%d}", w, i)})
				if err != nil {
					t.Error(err)
					return
				}
				ls.ReleaseInBackground("")
			}
		}(w)
	}
	wg.Wait()
	if !allFree(10*time.Second, "caddy:lock:{one-0-0}", rs) {
		t.Fatal("a lease stayed held")
	}
	const leases = workers * each
	for i := range releases {
		waitFor(5*time.Second, func() bool { return releases[i].Load() >= leases })
		if n := releases[i].Load(); n > leases+leases/20 {
			t.Errorf("server %d: %d releases for %d leases, want about one each", i, n, leases)
		}
	}
}

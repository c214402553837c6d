package redislock

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	dto "github.com/prometheus/client_model/go"
)

// Tests of the lock under ordinary Redis faults (pauses, restarts, lost
// answers, reloads). Each failed before its fix.

// heldBy reports how many holders a lock key has on r.
func heldBy(r *testRedis, key string) int64 {
	n, _ := r.Client().ZCard(context.Background(), key).Result()
	return n
}

// releaseFailures reads caddy_redis_lock_release_failures_total of one handler.
func releaseFailures(handler string) float64 {
	shared.InitMetrics()
	var m dto.Metric
	_ = shared.LockReleaseFailures.WithLabelValues(handler).Write(&m)
	return m.GetCounter().GetValue()
}

// freeWithin waits until no server holds key.
func freeWithin(d time.Duration, key string, rs ...*testRedis) bool {
	return waitFor(d, func() bool {
		for _, r := range rs {
			if heldBy(r, key) != 0 {
				return false
			}
		}
		return true
	})
}

// TestNoOrphanAfterLostAnswer: a locked request whose acquire's answer is
// lost (Redis paused past the timeout) is answered 503 and leaves nothing
// held for longer than about a second after Redis answers again; a release
// that Redis did not answer is counted in
// caddy_redis_lock_release_failures_total and retried.
func TestNoOrphanAfterLostAnswer(t *testing.T) {
	t.Parallel()
	t.Run("acquire timed out", func(t *testing.T) {
		t.Parallel()
		for _, n := range []int{1, 3} {
			rs, addrs := startRedlock(t, n)
			h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"keys":["a","b"],"timeout":"300ms","wait":"0s"}`, addrs))
			srv := handlerServer(t, h, okHandler)
			// Warm connections: the lost answers are those of calls that
			// reached Redis on a connection it already served.
			if resp, _ := get(t, srv.URL+"/"); resp == nil || resp.StatusCode != 200 {
				t.Fatalf("warm-up: %v", resp)
			}
			for _, r := range rs {
				r.Pause()
			}
			if resp, _ := get(t, srv.URL+"/"); resp == nil || resp.StatusCode != 503 {
				t.Fatalf("%d servers paused: %v, want 503", n, resp)
			}
			for _, r := range rs {
				r.Resume()
			}
			for _, k := range []string{shared.StoredKey(h.Prefix, "a"), shared.StoredKey(h.Prefix, "b")} {
				if !freeWithin(3*time.Second, k, rs...) {
					t.Fatalf("%d servers: %s still held 3s after Redis answered again", n, k)
				}
			}
			if resp, _ := get(t, srv.URL+"/"); resp == nil || resp.StatusCode != 200 {
				t.Fatalf("after the pause: %v, want 200", resp)
			}
		}
	})
	t.Run("release not answered", func(t *testing.T) {
		t.Parallel()
		r := startRedis(t)
		t.Cleanup(r.Resume) // whatever fails first
		h := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"300ms","ttl":"30s"`))
		// Redis stops answering while the route runs: the release after it
		// fails.
		srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
			r.Pause()
			return nil
		})
		before := releaseFailures(h.label)
		if resp, _ := get(t, srv.URL+"/rel"); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("the request whose release meets a paused Redis: %v, want 200", resp)
		}
		counted := waitFor(10*time.Second, func() bool { return releaseFailures(h.label) > before })
		r.Resume()
		if !counted {
			t.Fatal("the failed release was not counted in caddy_redis_lock_release_failures_total")
		}
		if !freeWithin(3*time.Second, shared.StoredKey(h.Prefix, "/rel"), r) {
			t.Fatal("a release Redis did not answer was not retried: the key is still held 3s after Redis answered again")
		}
	})
}

// TestReloadKeepsClientForRelease: when a reload drops the last handler of
// a connection while one of its requests still holds a lock, the client
// stays open until that lock is released, then closes.
func TestReloadKeepsClientForRelease(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h, cleanup := provisionLockScoped(t, testkit.LockConfig(r.Addr, `"timeout":"444ms"`))
	key := shared.StoredKey(h.Prefix, "/reload")
	ls, err := h.locker.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatal(err)
	}
	client := h.locker.Clients()[0]
	cleanup() // the old config goes away
	ls.Release()
	if heldBy(r, key) != 0 {
		t.Fatal("the release of a request of the old config did not reach Redis")
	}
	if !waitFor(3*time.Second, func() bool { return client.Ping(context.Background()).Err() != nil }) {
		t.Fatal("the old client was not closed after its last lock was released")
	}
}

// TestWakeMessagesAreOpaque: a client of a shared Redis that subscribes to
// the wake-up channel learns nothing of the keys being locked.
func TestWakeMessagesAreOpaque(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	sub := r.Client().Subscribe(context.Background(), lock.WakeChannel)
	defer sub.Close()
	if _, err := sub.Receive(context.Background()); err != nil {
		t.Fatal(err)
	}
	var got atomic.Value
	got.Store("")
	go func() {
		for m := range sub.Channel() {
			got.Store(got.Load().(string) + m.Payload + "\n")
		}
	}()
	release := make(chan struct{})
	openRelease := closer(release) // a failure before the planned close must not leave a handler blocked
	defer openRelease()
	up := func(w http.ResponseWriter, req *http.Request) error {
		if req.URL.Query().Get("hold") == "1" {
			<-release
		}
		return nil
	}
	a := provisionLock(t, testkit.LockConfig(r.Addr, `"wait":"10s"`))
	b := provisionLock(t, testkit.LockConfig(r.Addr, `"wait":"10s","timeout":"600ms"`))
	sa, sb := handlerServer(t, a, up), handlerServer(t, b, up)
	holder := testkit.GoFetch(context.Background(), sa.URL+"/secret-alice?hold=1")
	if !waitFor(10*time.Second, func() bool { return heldBy(r, shared.StoredKey(a.Prefix, "/secret-alice")) > 0 }) {
		t.Fatal("the holder never took the lock")
	}
	waiter := testkit.GoFetch(context.Background(), sb.URL+"/secret-alice")
	// Release once the waiter's instance is on the key's wait list (a
	// fixed sleep lost that race on a loaded machine).
	wq := lock.WaitqKey(shared.StoredKey(a.Prefix, "/secret-alice"))
	if !waitFor(10*time.Second, func() bool { return r.Client().ZCard(context.Background(), wq).Val() > 0 }) {
		t.Fatal("the waiter's instance never joined the wait list")
	}
	openRelease()
	testkit.Await(t, holder, 20*time.Second, "holder")
	testkit.Await(t, waiter, 20*time.Second, "waiter")
	if !waitFor(3*time.Second, func() bool { return got.Load().(string) != "" }) {
		t.Fatal("no wake-up published for a cross-instance waiter")
	}
	if msgs := got.Load().(string); strings.Contains(msgs, "alice") {
		t.Fatalf("wake-up messages show the lock key: %q", msgs)
	}
}

// onWaitList reports whether instance id is on a lock key's wait list on
// one of rs.
func onWaitList(rs []*testRedis, id string) bool {
	for _, r := range rs {
		keys, _ := r.Client().Keys(context.Background(), "*:waitq").Result()
		for _, k := range keys {
			if r.Client().ZScore(context.Background(), k, id).Err() == nil {
				return true
			}
		}
	}
	return false
}

// publishes counts the PUBLISH calls a server ran (also inside scripts).
func publishes(rs []*testRedis) int64 {
	var n int64
	for _, r := range rs {
		n += r.CommandCalls("publish")
	}
	return n
}

// TestReleasePublishesOnlyForOtherInstances: a release announces itself on
// Pub/Sub only when another instance waits for the key — on one server, a
// Redlock quorum and several keys alike — and a waiter of another instance
// is still woken by it (its backoff is far longer than the test).
func TestReleasePublishesOnlyForOtherInstances(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		servers int
		keys    string
	}{
		{"one server", 1, `["{http.request.uri.path}"]`},
		{"redlock", 3, `["{http.request.uri.path}"]`},
		{"several keys", 1, `["{http.request.uri.path}","b:{http.request.uri.path}"]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rs, addrs := startRedlock(t, tc.servers)
			release := make(chan struct{})
			openRelease := closer(release) // a failure before the planned close must not leave a handler blocked
			defer openRelease()
			entered := make(chan struct{}, 1)
			up := func(w http.ResponseWriter, req *http.Request) error {
				if req.URL.Query().Get("hold") == "1" {
					entered <- struct{}{}
					<-release
				}
				return nil
			}
			a := provisionLock(t, fmt.Sprintf(`{"redis":%s,"keys":%s,"wait":"20s","timeout":"2s"}`, addrs, tc.keys))
			b := provisionLock(t, fmt.Sprintf(`{"redis":%s,"keys":%s,"wait":"20s","timeout":"2100ms","backoff_min":"15s","backoff_max":"15s"}`, addrs, tc.keys))
			sa, sb := handlerServer(t, a, up), handlerServer(t, b, up)
			before := publishes(rs)
			for i := 0; i < 20; i++ {
				if resp, _ := get(t, fmt.Sprintf("%s/quiet%d", sa.URL, i)); resp == nil || resp.StatusCode != 200 {
					t.Fatalf("uncontended request %d: %v", i, resp)
				}
			}
			if n := publishes(rs) - before; n != 0 {
				t.Fatalf("20 uncontended releases published %d wake-ups, want 0", n)
			}
			holder := testkit.GoFetch(context.Background(), sa.URL+"/hot?hold=1")
			recvWithin(t, (<-chan struct{})(entered), 15*time.Second, "the holder reaching the upstream")
			waiter := testkit.GoFetch(context.Background(), sb.URL+"/hot")
			// b's attempt failed and it waits: its instance is on a wait list.
			if !waitFor(15*time.Second, func() bool { return onWaitList(rs, lockInstanceID(b)) }) {
				t.Fatal("the waiter's instance never joined a wait list")
			}
			start := time.Now()
			openRelease()
			if res := testkit.Await(t, waiter, 20*time.Second, "waiter"); res.Status != 200 {
				t.Fatalf("waiter: %d %v", res.Status, res.Err)
			}
			if el := time.Since(start); el > 5*time.Second {
				t.Errorf("the other instance's waiter got the lock %s after the release; its backoff is 15s, so the wake-up was lost", el)
			}
			testkit.Await(t, holder, 20*time.Second, "holder")
			if publishes(rs)-before == 0 {
				t.Error("no wake-up published although another instance waited")
			}
		})
	}
}

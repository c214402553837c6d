package redisdlm

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
)

// Tests of the lock under ordinary Redis faults (pauses, restarts, lost
// answers, reloads). Each failed before its fix.

// heldBy reports how many holders a lock key has on r.
func heldBy(r *testRedis, key string) int64 {
	n, _ := r.Client().ZCard(context.Background(), key).Result()
	return n
}

// TestPausedHolderIsNotRevived: a holder whose process was paused past its
// lease (modelled by a lease nobody extends) must find it lost when it
// extends again — on one server and on a Redlock quorum, where the extend
// script used to re-create the missing lease — even after a rival held
// and released the lock meanwhile.
func TestPausedHolderIsNotRevived(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, rs []*testRedis, addrs string) {
		h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"ttl":"600ms","wait":"5s","timeout":"2s"}`, addrs))
		rival := provisionLock(t, fmt.Sprintf(`{"redis":%s,"ttl":"600ms","wait":"5s","timeout":"2100ms"}`, addrs))
		keys := []string{storedKey(h.Prefix, "/paused")}
		ls, err := h.locker.Acquire(context.Background(), keys)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(800 * time.Millisecond) // "paused" past the lease
		other, err := rival.locker.Acquire(context.Background(), keys)
		if err != nil {
			t.Fatalf("rival: %v", err)
		}
		other.Release()
		err = h.locker.Extend(context.Background(), ls)
		if !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("extension after the lease ran out: %v, want ErrLeaseLost", err)
		}
		for _, r := range rs {
			// The rival's release may still be on its way to a minority;
			// what must not be there is the lapsed lease's own token.
			if _, err := r.Client().ZScore(context.Background(), keys[0], ls.Token()).Result(); err != redis.Nil {
				t.Errorf("%s holds the lapsed lease again (%v)", r, err)
			}
		}
		// The keeper reports it through on_lost.
		lost := make(chan error, 1)
		k := ls.Keep(lock.KeepOptions{Extend: true, OnLost: func(err error) { lost <- err }})
		defer k.Stop()
		select {
		case err := <-lost:
			if !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("on_lost got %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the keeper did not report the lapsed lease lost")
		}
	})
}

// releaseFailures reads caddy_redis_lock_release_failures_total of one handler.
func releaseFailures(handler string) float64 {
	initMetrics()
	var m dto.Metric
	_ = lockReleaseFailures.WithLabelValues(handler).Write(&m)
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

// TestNoOrphanAfterLostAnswer: a lock call whose answer is lost (Redis
// paused past the timeout, or the client gone mid-call) leaves nothing held
// for longer than about a second after Redis answers again; so does a
// release that Redis did not answer, which is also counted.
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
			for _, k := range []string{storedKey(h.Prefix, "a"), storedKey(h.Prefix, "b")} {
				if !freeWithin(3*time.Second, k, rs...) {
					t.Fatalf("%d servers: %s still held 3s after Redis answered again", n, k)
				}
			}
			if resp, _ := get(t, srv.URL+"/"); resp == nil || resp.StatusCode != 200 {
				t.Fatalf("after the pause: %v, want 200", resp)
			}
		}
	})
	t.Run("client gone mid-call", func(t *testing.T) {
		t.Parallel()
		r := startRedis(t)
		h := provisionLock(t, lockCfg(r.Addr, `"timeout":"3s","wait":"10s"`))
		key := storedKey(h.Prefix, "/gone")
		warm, err := h.locker.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatal(err)
		}
		warm.Release()
		r.Pause()
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		_, err = h.locker.Acquire(ctx, []string{key})
		cancel()
		if err == nil {
			t.Fatal("acquired with Redis paused")
		}
		r.Resume()
		if !freeWithin(3*time.Second, key, r) {
			t.Fatal("the lease of a caller that went away mid-call is still held 3s after Redis answered again")
		}
	})
	t.Run("release not answered", func(t *testing.T) {
		t.Parallel()
		r := startRedis(t)
		h := provisionLock(t, lockCfg(r.Addr, `"timeout":"300ms","ttl":"30s"`))
		key := storedKey(h.Prefix, "/rel")
		ls, err := h.locker.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatal(err)
		}
		before := releaseFailures(h.label)
		r.Pause()
		ls.Release()
		time.Sleep(500 * time.Millisecond)
		r.Resume()
		if !freeWithin(3*time.Second, key, r) {
			t.Fatal("a release Redis did not answer was not retried: the key is still held 3s after Redis answered again")
		}
		if releaseFailures(h.label) <= before {
			t.Error("the failed release was not counted in caddy_redis_lock_release_failures_total")
		}
	})
}

// TestFencingTokensSurviveRestartAndExpiry: tokens strictly increase across
// a Redis restarted empty and across the expiry of the fencing counter,
// which expires once its lock is idle.
func TestFencingTokensSurviveRestartAndExpiry(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"ttl":"200ms"`))
	key := storedKey(h.Prefix, "/fence")
	var last int64
	take := func(what string) {
		t.Helper()
		ls, err := h.locker.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ls.Fence() <= last {
			t.Fatalf("%s: token %d after %d", what, ls.Fence(), last)
		}
		last = ls.Fence()
		ls.Release()
	}
	for i := 0; i < 3; i++ {
		take("before the restart")
	}
	if pttl, _ := r.Client().PTTL(context.Background(), lock.FenceKey(key)).Result(); pttl <= 0 {
		t.Fatalf("fencing counter has no expiry (PTTL %s)", pttl)
	}
	r.Restart()
	take("after a restart empty")
	if !waitFor(5*time.Second, func() bool {
		n, _ := r.Client().Exists(context.Background(), lock.FenceKey(key)).Result()
		return n == 0
	}) {
		t.Fatal("fencing counter of an idle lock did not expire")
	}
	take("after the counter expired")
}

// TestReloadKeepsClientForRelease: when a reload drops the last handler of
// a connection while one of its requests still holds a lock, the client
// stays open until that lock is released, then closes.
func TestReloadKeepsClientForRelease(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h, cleanup := provisionLockScoped(t, lockCfg(r.Addr, `"timeout":"444ms"`))
	key := storedKey(h.Prefix, "/reload")
	ls, err := h.locker.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatal(err)
	}
	client := h.locker.Servers()[0].Client()
	cleanup() // the old config goes away
	ls.Release()
	if heldBy(r, key) != 0 {
		t.Fatal("the release of a request of the old config did not reach Redis")
	}
	if !waitFor(3*time.Second, func() bool { return client.Ping(context.Background()).Err() != nil }) {
		t.Fatal("the old client was not closed after its last lock was released")
	}
}

// TestRedlockRestartedMemberRecreatedAtOnce: the extension round after a
// member restarted empty re-creates the lease there, although a majority
// answered first (its call is not cut off).
func TestRedlockRestartedMemberRecreatedAtOnce(t *testing.T) {
	t.Parallel()
	rs, addrs := startRedlock(t, 3)
	h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"ttl":"20s","timeout":"2s"}`, addrs))
	key := storedKey(h.Prefix, "/member")
	ls, err := h.locker.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatal(err)
	}
	defer ls.Release()
	rs[0].Restart()
	ctx, cancel := context.WithCancel(context.Background())
	if err := h.locker.Extend(ctx, ls); err != nil {
		t.Fatalf("extend: %v", err)
	}
	cancel() // as the keeper does after each round
	if !waitFor(3*time.Second, func() bool { return heldBy(rs[0], key) == 1 }) {
		t.Fatal("the restarted member did not get the lease back in this extension round")
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
	up := func(w http.ResponseWriter, req *http.Request) error {
		if req.URL.Query().Get("hold") == "1" {
			<-release
		}
		return nil
	}
	a := provisionLock(t, lockCfg(r.Addr, `"wait":"10s"`))
	b := provisionLock(t, lockCfg(r.Addr, `"wait":"10s","timeout":"600ms"`))
	sa, sb := handlerServer(t, a, up), handlerServer(t, b, up)
	holder := goFetch(context.Background(), sa.URL+"/secret-alice?hold=1")
	time.Sleep(200 * time.Millisecond)
	waiter := goFetch(context.Background(), sb.URL+"/secret-alice")
	// Release once the waiter's instance is on the key's wait list (a
	// fixed sleep lost that race on a loaded machine).
	wq := lock.WaitqKey(storedKey(a.Prefix, "/secret-alice"))
	if !waitFor(10*time.Second, func() bool { return r.Client().ZCard(context.Background(), wq).Val() > 0 }) {
		t.Fatal("the waiter's instance never joined the wait list")
	}
	close(release)
	await(t, holder, 20*time.Second, "holder")
	await(t, waiter, 20*time.Second, "waiter")
	if !waitFor(3*time.Second, func() bool { return got.Load().(string) != "" }) {
		t.Fatal("no wake-up published for a cross-instance waiter")
	}
	if msgs := got.Load().(string); strings.Contains(msgs, "alice") {
		t.Fatalf("wake-up messages show the lock key: %q", msgs)
	}
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
			holder := goFetch(context.Background(), sa.URL+"/hot?hold=1")
			<-entered
			waiter := goFetch(context.Background(), sb.URL+"/hot")
			time.Sleep(500 * time.Millisecond) // b's attempt failed and it waits
			start := time.Now()
			close(release)
			if res := await(t, waiter, 20*time.Second, "waiter"); res.status != 200 {
				t.Fatalf("waiter: %d %v", res.status, res.err)
			}
			if el := time.Since(start); el > 5*time.Second {
				t.Errorf("the other instance's waiter got the lock %s after the release; its backoff is 15s, so the wake-up was lost", el)
			}
			await(t, holder, 20*time.Second, "holder")
			if publishes(rs)-before == 0 {
				t.Error("no wake-up published although another instance waited")
			}
		})
	}
}

// TestReloadGraceForRequestsOnTheirWay: a reload's old servers finish their
// requests after Cleanup, and such a request may reach the lock or the
// limiter only then (after a slow forward_auth, say). For destructGrace
// (10 s in Caddy) the old client still serves it, and an admission's
// settle after Cleanup is still sent. After that the client is closed and
// no new batcher is started on it. Before, the client closed at Cleanup:
// such requests got "redis: client is closed" (503), and a settle was lost.
func TestReloadGraceForRequestsOnTheirWay(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h, cleanup := provisionLockScoped(t, lockCfg(r.Addr, `"timeout":"456ms"`))
	rl, rlCleanup := newRateLimitScoped(t, r, func(rl *RedisRateLimit) {
		rl.Rates, rl.Count = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}, []string{"401"}
		rl.Timeout = caddy.Duration(456 * time.Millisecond) // the lock's client
	})
	if rl.client.lock != h.locker.Servers()[0] {
		t.Fatal("the lock and the limiter with the same settings do not share a client")
	}
	cleanup()                     // the old config goes away ...
	rlCleanup()                   // ... with both handlers
	time.Sleep(destructGrace / 2) // while its requests are on their way
	ls, err := h.locker.Acquire(context.Background(), []string{storedKey(h.Prefix, "/late")})
	if err != nil {
		t.Fatalf("a lock request of the old config after Cleanup: %v", err)
	}
	ls.Release()
	ok := func(status int) caddyhttp.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) error { w.WriteHeader(status); return nil }
	}
	if a := serveRLWith(context.Background(), rl, "192.0.2.90", nil, ok(200)); !a.passed {
		t.Fatalf("a limited request of the old config after Cleanup: %d %v", a.status, a.err)
	}
	// Its answer did not count: the settle gave the unit back.
	if a := serveRLWith(context.Background(), rl, "192.0.2.90", nil, ok(401)); !a.passed {
		t.Fatalf("after a settle sent after Cleanup: %d %v, want the unit given back", a.status, a.err)
	}
	client := rl.client.client
	if !waitFor(destructGrace+5*time.Second, func() bool { return client.Ping(context.Background()).Err() != nil }) {
		t.Fatal("the old client was not closed after the grace")
	}
	if _, err := rl.client.rateLimit(context.Background(), &ratelimit.Call{Script: ratelimit.SlidingScript}, (*breakerLog)(rl)); !errors.Is(err, ratelimit.ErrBatcherDone) {
		t.Fatalf("a call on a closed client: %v, want ratelimit.ErrBatcherDone", err)
	}
	if b := rl.client.batcher(); b == nil {
		t.Fatal("no batcher: the limiter's calls did not run")
	} else {
		select {
		case <-b.Stopped():
		default:
			t.Fatal("the batcher of a closed client still runs")
		}
	}
}

// TestSettleAfterTheGrace: a limited request of the old config admitted
// during the grace and answered after it still gives its reservation back
// (count): its handler keeps the client open until it ends. Before, the
// client closed at the end of the grace and the settle was lost.
func TestSettleAfterTheGrace(t *testing.T) {
	// Not parallel: it times a settle against the reload grace, which a machine busy with 15 other tests cannot promise.
	r := startRedis(t)
	mk := func(timeout time.Duration) (*RedisRateLimit, func()) {
		return newRateLimitScoped(t, r, func(rl *RedisRateLimit) {
			rl.Rates, rl.Count = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}, []string{"401"}
			rl.Timeout = caddy.Duration(timeout) // a client of its own
		})
	}
	old, reload := mk(567 * time.Millisecond)
	reload() // the request below is on its way
	slow := func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(destructGrace + 300*time.Millisecond) // answers after the grace
		w.WriteHeader(http.StatusOK)                     // not counted: the unit goes back
		return nil
	}
	if a := serveRLWith(context.Background(), old, "192.0.2.91", nil, slow); !a.passed {
		t.Fatalf("the old config's request: %d %v", a.status, a.err)
	}
	fresh, _ := mk(678 * time.Millisecond)
	if a := serveRLWith(context.Background(), fresh, "192.0.2.91", nil, nil); !a.passed {
		t.Fatalf("the unit of an answer that did not count was not given back: %d %q", a.status, a.header.Get(HeaderRateLimit))
	}
}

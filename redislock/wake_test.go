package redislock

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// waitFor polls cond every 5ms until it holds or d has passed.
var waitFor = testredis.WaitFor

// Tests of the fast, fair hand-off on a hot key:
// waiters are woken by a release (local queue, Pub/Sub across instances),
// polling is only the fallback for a missed wake-up, no wake-up is lost
// between a failed attempt and the subscription, nobody starves on a hot
// key, canceled waiters leave at once, max_waiters is per instance.
//
// They are black-box: they drive the handler over HTTP and look at Redis;
// the only internal read is lockWaitersFor (the local queue length). Two
// "instances" are two handlers with different `timeout` values, which gives
// them separate Redis clients, local queues, Pub/Sub listeners and ids.

// wakeSubscribers counts the Pub/Sub subscribers of the wake-up channel.
func wakeSubscribers(c *redis.Client) int64 {
	m, err := c.PubSubNumSub(context.Background(), lock.WakeChannel).Result()
	if err != nil {
		return -1
	}
	return m[lock.WakeChannel]
}

// provisionLockScoped is provisionLock for an instance that lives for part
// of a test: the returned function cleans it up (once; it also runs when
// the test ends).
func provisionLockScoped(t *testing.T, cfg string) (*RedisLock, func()) {
	t.Helper()
	h := new(RedisLock)
	done := testkit.ProvisionScoped(t, cfg, h)
	quietLock(h)
	return h, done
}

// swapHandler serves through whichever RedisLock is current, so one HTTP
// server can front a fresh instance in every pass.
type swapHandler struct{ h atomic.Pointer[RedisLock] }

func (s *swapHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	return s.h.Load().ServeHTTP(w, r, next)
}

// queueWaiter sends a waiter's request to url and returns once it is queued
// in instance h for path and a wake-up subscriber listens.
func queueWaiter(t *testing.T, rc *redis.Client, h *RedisLock, url, path string) <-chan testkit.FetchResult {
	t.Helper()
	waiter := testkit.GoFetch(context.Background(), url+path+"?who=b")
	if !waitFor(10*time.Second, func() bool { return lockWaitersFor(h, path) == 1 }) {
		t.Fatal("waiter never queued in instance B")
	}
	if !waitFor(10*time.Second, func() bool { return wakeSubscribers(rc) >= 1 }) {
		t.Fatalf("no subscriber on %s while B waits", lock.WakeChannel)
	}
	return waiter
}

// acrossInstances is the start of the wake-up tests: instance A holds path
// on up (until up.Release), and instance B, with the backoff given, waits
// for it, queued and subscribed.
type acrossInstances struct {
	rc     *redis.Client
	up     *testkit.HoldUpstream
	a, b   *RedisLock
	waiter <-chan testkit.FetchResult
}

// heldAcrossInstances starts them on r; the holder's answer is awaited
// when the test ends.
func heldAcrossInstances(t *testing.T, r *testredis.Server, backoff, path string) acrossInstances {
	t.Helper()
	x := acrossInstances{rc: r.Client(), up: testkit.NewHoldUpstream()}
	x.a = provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"2s","ttl":"60s","wait":"30s"`))
	x.b = provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"3s","ttl":"60s","wait":"30s",`+backoff))
	if lockInstanceID(x.a) == lockInstanceID(x.b) {
		t.Fatal("instances share a domain; want separate clients")
	}
	sa, sb := handlerServer(t, x.a, x.up.ServeHTTP), handlerServer(t, x.b, x.up.ServeHTTP)
	holder := testkit.StartHolder(t, x.up, sa.URL+path)
	t.Cleanup(func() { testkit.Await(t, holder, 40*time.Second, "holder") })
	x.waiter = queueWaiter(t, x.rc, x.b, sb.URL, path)
	return x
}

// TestWakeCrossInstanceWithoutBackoff: a waiter in another instance is woken
// by the release through Pub/Sub, not by its backoff poll. Its backoff is
// 20s and the holder's lease 60s (so the poll, capped by the remaining
// lease, would also sleep 20s); it must get the lock within 2s of the
// release.
func TestWakeCrossInstanceWithoutBackoff(t *testing.T) {
	t.Parallel()
	// B is queued, has failed an attempt, is subscribed and sleeps in its
	// 20s backoff.
	x := heldAcrossInstances(t, startRedis(t), `"backoff_min":"20s","backoff_max":"20s"`, "/hot")
	up, waiter := x.up, x.waiter
	time.Sleep(300 * time.Millisecond)
	if who, ok := up.NextEntered(0); ok {
		t.Fatalf("%q entered the upstream while the holder held the lock", who)
	}

	releasedAt := time.Now()
	up.Release()
	who, ok := up.NextEntered(25 * time.Second)
	if !ok || who != "b" {
		t.Fatalf("after the release, entered %q (ok=%v); want b", who, ok)
	}
	at, _ := up.EnteredAt("b")
	if el := at.Sub(releasedAt); el > 2*time.Second {
		t.Errorf("cross-instance waiter got the lock %s after the release; want < 2s (its backoff is 20s: the Pub/Sub wake-up did not work)", el)
	} else {
		t.Logf("cross-instance hand-off took %s", el)
	}
	if res := testkit.Await(t, waiter, 40*time.Second, "waiter"); res.Status != 200 {
		t.Errorf("waiter: status %d err %v", res.Status, res.Err)
	}
}

// TestWakeDroppedIsRecoveredByPolling: when the wake-up is missed, the
// backoff poll still hands the lock to the waiter soon after it is free.
// Two ways to miss it: the lock key vanishes behind the holder's back
// (nobody publishes), and the Pub/Sub connections are killed around the
// release.
func TestWakeDroppedIsRecoveredByPolling(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"lock_deleted", "pubsub_killed"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			x := heldAcrossInstances(t, r, `"backoff_min":"50ms","backoff_max":"200ms"`, "/drop")
			rc, up, a, waiter := x.rc, x.up, x.a, x.waiter
			ctx := context.Background()
			time.Sleep(300 * time.Millisecond)

			var freedAt time.Time
			switch mode {
			case "lock_deleted":
				// The lease vanishes (as if expired early); no release script
				// runs, so nothing is published.
				freedAt = time.Now()
				if err := rc.Del(ctx, shared.StoredKey(a.Prefix, "/drop")).Err(); err != nil {
					t.Fatal(err)
				}
			case "pubsub_killed":
				// Kill every Pub/Sub connection, again and again, around the
				// release, so its announcement reaches no listener.
				stop := make(chan struct{})
				killed := make(chan int64, 1)
				go func() {
					var n int64
					kc := r.Client()
					deadline := time.Now().Add(time.Second)
					for time.Now().Before(deadline) {
						select {
						case <-stop:
							deadline = time.Now()
						default:
						}
						k, _ := kc.ClientKillByFilter(ctx, "TYPE", "pubsub").Result()
						n += k
						time.Sleep(2 * time.Millisecond)
					}
					killed <- n
				}()
				time.Sleep(30 * time.Millisecond)
				freedAt = time.Now()
				up.Release()
				defer func() {
					close(stop)
					t.Logf("killed %d pubsub connections", <-killed)
				}()
			}
			who, ok := up.NextEntered(25 * time.Second)
			if !ok || who != "b" {
				t.Fatalf("after the lock was freed, entered %q (ok=%v); want b", who, ok)
			}
			at, _ := up.EnteredAt("b")
			if el := at.Sub(freedAt); el > 3*time.Second {
				t.Errorf("waiter got the lock %s after it was freed; want < 3s (backoff 50ms-200ms)", el)
			} else {
				t.Logf("recovered by polling after %s", el)
			}
			up.Release()
			if res := testkit.Await(t, waiter, 40*time.Second, "waiter"); res.Status != 200 {
				t.Errorf("waiter: status %d err %v", res.Status, res.Err)
			}
		})
	}
}

// TestWakeListenerResubscribes: after its Pub/Sub connection is killed, an
// instance's wake-up listener subscribes again by itself, and cross-instance
// hand-offs are fast again (the waiter's backoff is 20s).
func TestWakeListenerResubscribes(t *testing.T) {
	t.Parallel()
	x := heldAcrossInstances(t, startRedis(t), `"backoff_min":"20s","backoff_max":"20s"`, "/re")
	rc, up, waiter := x.rc, x.up, x.waiter
	ctx := context.Background()
	n, err := rc.ClientKillByFilter(ctx, "TYPE", "pubsub").Result()
	if err != nil || n < 1 {
		t.Fatalf("CLIENT KILL TYPE pubsub: %d killed, %v", n, err)
	}
	time.Sleep(50 * time.Millisecond)
	if !waitFor(10*time.Second, func() bool { return wakeSubscribers(rc) >= 1 }) {
		t.Fatalf("the wake-up listener did not subscribe again within 10s of losing its connection")
	}
	time.Sleep(300 * time.Millisecond)

	releasedAt := time.Now()
	up.Release()
	who, ok := up.NextEntered(25 * time.Second)
	if !ok || who != "b" {
		t.Fatalf("after the release, entered %q (ok=%v); want b", who, ok)
	}
	at, _ := up.EnteredAt("b")
	if el := at.Sub(releasedAt); el > 2*time.Second {
		t.Errorf("after the listener reconnected, the cross-instance waiter got the lock %s after the release; want < 2s (backoff 20s)", el)
	}
	if res := testkit.Await(t, waiter, 40*time.Second, "waiter"); res.Status != 200 {
		t.Errorf("waiter: status %d err %v", res.Status, res.Err)
	}
}

// TestWakeNoLostWakeupRace: many passes of a very short hold by A while B
// asks, with B's backoff at 20s and the lease at 60s, so a lost wake-up
// shows as a 5s+ wait. The release lands at random points of B's attempt:
// before it, between its failed attempt and its subscription (a fresh
// instance B every third pass, so it subscribes anew), between the attempt
// and its sleep (an instance already subscribed), and within one instance
// (local queue).
func TestWakeNoLostWakeupRace(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	const waiterCfg = `"ttl":"60s","wait":"30s","backoff_min":"20s","backoff_max":"20s"`
	type pass struct {
		aIn  chan struct{}
		bGo  chan struct{}
		hold time.Duration
	}
	var cur atomic.Pointer[pass]
	up := func(w http.ResponseWriter, req *http.Request) error {
		if req.URL.Query().Get("who") == "a" {
			rd := cur.Load()
			close(rd.aIn)
			<-rd.bGo
			if rd.hold >= 300*time.Microsecond {
				time.Sleep(rd.hold)
			}
		}
		return nil
	}
	a := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"2s","ttl":"60s","wait":"30s"`))
	b := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"3s",`+waiterCfg))
	sa, sb := handlerServer(t, a, up), handlerServer(t, b, up)
	fresh := new(swapHandler)
	sf := handlerServer(t, fresh, up)

	const passes = 210
	const bBound = 5 * time.Second
	start := time.Now()
	var worst [3]time.Duration
	var done [3]int
	kinds := [3]string{"fresh instance (subscribes)", "other instance (subscribed)", "same instance"}
	for i := 0; i < passes; i++ {
		if time.Since(start) > 25*time.Second {
			t.Logf("stopping after %d passes: 25s budget used", i)
			break
		}
		kind := i % 3
		aURL, bURL := sa.URL, sb.URL
		var cleanup func()
		switch kind {
		case 0:
			h, c := provisionLockScoped(t, testkit.LockConfig(r.Addr, fmt.Sprintf(`"timeout":"%dms",`, 4000+i)+waiterCfg))
			fresh.h.Store(h)
			bURL, cleanup = sf.URL, c
		case 2:
			aURL = sb.URL
		}
		rd := &pass{aIn: make(chan struct{}), bGo: make(chan struct{}), hold: rand.N(4 * time.Millisecond)}
		cur.Store(rd)
		aRes := testkit.GoFetch(context.Background(), aURL+"/race?who=a")
		select {
		case <-rd.aIn:
		case <-time.After(10 * time.Second):
			close(rd.bGo)
			t.Fatalf("pass %d: A did not get the lock within 10s", i)
		}
		ctx, cancel := context.WithTimeout(context.Background(), bBound)
		bRes := testkit.GoFetch(ctx, bURL+"/race?who=b")
		close(rd.bGo)
		ra := testkit.Await(t, aRes, 40*time.Second, "A")
		rb := testkit.Await(t, bRes, 40*time.Second, "B")
		cancel()
		if cleanup != nil {
			cleanup()
		}
		if ra.Status != 200 {
			t.Fatalf("pass %d: A status %d err %v", i, ra.Status, ra.Err)
		}
		if rb.Status != 200 {
			t.Fatalf("pass %d (%s, A held %s after B was sent): B not served within %s: status %d err %v — a lost wake-up (B's backoff is 20s)",
				i, kinds[kind], rd.hold, bBound, rb.Status, rb.Err)
		}
		if rb.Took > worst[kind] {
			worst[kind] = rb.Took
		}
		done[kind]++
	}
	for k := range kinds {
		t.Logf("%s: %d passes, slowest B %s", kinds[k], done[k], worst[k])
	}
	t.Logf("total %s", time.Since(start))
}

// TestHotKeyNoStarvationTwoInstances: 16 clients (8 per instance) in closed
// loops on one key, 2ms upstream, for 3s. Every client is served several
// times, the upstream never sees two holders, and fencing tokens strictly
// increase in the order the upstream sees them.
func TestHotKeyNoStarvationTwoInstances(t *testing.T) {
	// Not parallel: it counts how often each client is served in 3 s, which a machine busy with 15 other tests cannot promise.
	r := startRedis(t)
	up := testkit.NewExclusivityUpstream(2 * time.Millisecond)
	a := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"2s","wait":"30s"`))
	b := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"3s","wait":"30s"`))
	if lockInstanceID(a) == lockInstanceID(b) {
		t.Fatal("instances share a domain; want separate clients")
	}
	srv := [2]string{handlerServer(t, a, up.ServeHTTP).URL, handlerServer(t, b, up.ServeHTTP).URL}
	const perInstance = 8
	const clients = 2 * perInstance
	const run = 3 * time.Second
	served := make([]int, clients)
	failed := make([]int, clients)
	var firstErr sync.Once
	var errMsg atomic.Value
	deadline := time.Now().Add(run)
	start := time.Now()
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			url := srv[c%2] + "/hot"
			for time.Now().Before(deadline) {
				status, _, err := testkit.Fetch(context.Background(), url)
				if status == 200 {
					served[c]++
				} else {
					failed[c]++
					firstErr.Do(func() { errMsg.Store(fmt.Sprintf("client %d: status %d err %v", c, status, err)) })
				}
			}
		}(c)
	}
	wg.Wait()
	wall := time.Since(start)
	up.Check(t)
	if m, ok := errMsg.Load().(string); ok {
		t.Errorf("failed requests (first: %s)", m)
	}
	var inst [2]int
	total := 0
	sorted := append([]int(nil), served...)
	sort.Ints(sorted)
	for c, n := range served {
		inst[c%2] += n
		total += n
		if n < 3 {
			t.Errorf("client %d (instance %d) served %d times in %s; want at least 3 (starved)", c, c%2, n, run)
		}
	}
	t.Logf("served %d in %s (%.0f/s); per client min %d max %d (%v); per instance A %d B %d; failed %v",
		total, wall.Round(time.Millisecond), float64(total)/wall.Seconds(), sorted[0], sorted[len(sorted)-1], served, inst[0], inst[1], failed)
	upServed := up.Served()
	if total != upServed {
		t.Errorf("clients saw %d served, upstream %d", total, upServed)
	}
}

// TestCanceledWaitersLeaveQueueAtOnce: waiters whose clients go away leave
// the local queue at once, pass the turn on to a live waiter behind them,
// and leave nothing in Redis that holds up another instance.
func TestCanceledWaitersLeaveQueueAtOnce(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	const n = 10
	var reached atomic.Int32 // canceled waiters that reached the upstream
	ups := [2]*testkit.HoldUpstream{testkit.NewHoldUpstream(), testkit.NewHoldUpstream()}
	upFor := func(u *testkit.HoldUpstream) func(http.ResponseWriter, *http.Request) error {
		return func(w http.ResponseWriter, req *http.Request) error {
			if req.URL.Query().Get("who") == "doomed" {
				reached.Add(1)
			}
			return u.ServeHTTP(w, req)
		}
	}
	// The waiters' instance: a 20s backoff, so only a wake-up is "at once".
	w := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"2s","ttl":"60s","wait":"30s","backoff_min":"20s","backoff_max":"20s"`))
	// Another instance, answering at once (wait 0).
	p := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"3s","ttl":"60s","wait":0`))

	for phase, u := range ups {
		path := fmt.Sprintf("/c%d", phase)
		sw := handlerServer(t, w, upFor(u))
		sp := handlerServer(t, p, upFor(u))
		// Phase 0 holds in the waiters' own instance (local hand-off);
		// phase 1 in the other, so the waiters ask Redis and queue there.
		holderURL := sw.URL
		if phase == 1 {
			holderURL = sp.URL
		}
		holder := testkit.GoFetch(context.Background(), holderURL+path+"?who=holder")
		released := false
		release := func() {
			if !released {
				released = true
				u.Release()
			}
		}
		if who, ok := u.NextEntered(10 * time.Second); !ok || who != "holder" {
			release()
			t.Fatalf("phase %d: holder did not get the lock (entered %q)", phase, who)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var doomed []<-chan testkit.FetchResult
		for i := 0; i < n; i++ {
			doomed = append(doomed, testkit.GoFetch(ctx, sw.URL+path+"?who=doomed"))
		}
		if !waitFor(10*time.Second, func() bool { return lockWaitersFor(w, path) == n }) {
			cancel()
			release()
			t.Fatalf("phase %d: %d of %d waiters queued", phase, lockWaitersFor(w, path), n)
		}
		var next <-chan testkit.FetchResult
		want := 0
		if phase == 0 {
			// A live waiter behind the doomed ones.
			next = testkit.GoFetch(context.Background(), sw.URL+path+"?who=next")
			want = 1
			if !waitFor(10*time.Second, func() bool { return lockWaitersFor(w, path) == n+1 }) {
				cancel()
				release()
				t.Fatalf("phase 0: the live waiter never queued")
			}
		}
		time.Sleep(100 * time.Millisecond)
		canceledAt := time.Now()
		cancel()
		left := waitFor(2*time.Second, func() bool { return lockWaitersFor(w, path) == want })
		if !left {
			t.Errorf("phase %d: %d waiters still queued 2s after %d clients went away; want %d", phase, lockWaitersFor(w, path), n, want)
		} else {
			t.Logf("phase %d: canceled waiters left the queue in %s", phase, time.Since(canceledAt))
		}
		for i, ch := range doomed {
			if res := testkit.Await(t, ch, 10*time.Second, "canceled waiter"); res.Err == nil {
				t.Errorf("phase %d: canceled waiter %d got an answer %d", phase, i, res.Status)
			}
		}

		releasedAt := time.Now()
		release()
		if res := testkit.Await(t, holder, 40*time.Second, "holder"); res.Status != 200 {
			t.Errorf("phase %d: holder status %d err %v", phase, res.Status, res.Err)
		}
		if phase == 0 {
			// The turn passed through the canceled waiters to the live one,
			// which is woken by the release (not its 20s poll).
			if who, ok := u.NextEntered(25 * time.Second); !ok || who != "next" {
				t.Errorf("phase 0: after the release, entered %q (ok=%v); want next", who, ok)
			} else if at, _ := u.EnteredAt("next"); at.Sub(releasedAt) > 2*time.Second {
				t.Errorf("phase 0: the live waiter got the lock %s after the release; want at once (backoff 20s)", at.Sub(releasedAt))
			}
			if res := testkit.Await(t, next, 40*time.Second, "next"); res.Status != 200 {
				t.Errorf("phase 0: next status %d err %v", res.Status, res.Err)
			}
		} else {
			// Nobody waits any more: another instance takes the free lock at
			// once; nothing left by the canceled waiters (such as their
			// instance's turn in Redis, which would last 41s) holds it back.
			// (A moment for a give-up that is sent in the background.)
			time.Sleep(500 * time.Millisecond)
			res := testkit.Await(t, testkit.GoFetch(context.Background(), sp.URL+path+"?who=other"), 20*time.Second, "other instance")
			if res.Status != 200 {
				t.Errorf("phase 1: another instance with wait 0 got status %d (Retry-After %q) on the free lock; the canceled waiters left something behind",
					res.Status, res.Hdr.Get("Retry-After"))
			}
		}
	}
	if k := reached.Load(); k != 0 {
		t.Errorf("%d canceled waiters reached the upstream", k)
	}
}

// TestMaxWaitersCountsPerInstance: max_waiters caps the waiters of a key in
// one instance, not across instances: with max_waiters 1 on two instances,
// each admits one waiter (the holder is no waiter) and answers the next at
// once with the status and Retry-After.
func TestMaxWaitersCountsPerInstance(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := testkit.NewHoldUpstream()
	a := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"2s","ttl":"60s","wait":"30s","max_waiters":1`))
	b := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"3s","ttl":"60s","wait":"30s","max_waiters":1`))
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
	holder := testkit.StartHolder(t, up, sa.URL+"/mw")
	type inst struct {
		name string
		h    *RedisLock
		url  string
	}
	var admitted []<-chan testkit.FetchResult
	for _, in := range []inst{{"A (holds the lock)", a, sa.URL}, {"B", b, sb.URL}} {
		admitted = append(admitted, testkit.GoFetch(context.Background(), in.url+"/mw?who=waiter"))
		if !waitFor(10*time.Second, func() bool { return lockWaitersFor(in.h, "/mw") == 1 }) {
			t.Errorf("instance %s: its first waiter was not admitted (%d queued)", in.name, lockWaitersFor(in.h, "/mw"))
		}
		start := time.Now()
		res := testkit.Await(t, testkit.GoFetch(context.Background(), in.url+"/mw?who=extra"), 20*time.Second, "extra")
		if res.Status != 423 {
			t.Errorf("instance %s: a second waiter got status %d (err %v); want 423 at once", in.name, res.Status, res.Err)
		} else if ra, err := strconv.Atoi(res.Hdr.Get("Retry-After")); err != nil || ra < 1 {
			t.Errorf("instance %s: Retry-After %q; want whole seconds ≥ 1", in.name, res.Hdr.Get("Retry-After"))
		}
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("instance %s: the refused waiter was answered after %s; want at once", in.name, el)
		}
	}
	// Both admitted waiters are still waiting (neither was refused).
	results := make([]*testkit.FetchResult, len(admitted))
	for i, ch := range admitted {
		select {
		case res := <-ch:
			results[i] = &res
			t.Errorf("admitted waiter %d answered %d (err %v) while the lock was held", i, res.Status, res.Err)
		default:
		}
	}
	up.Release()
	if res := testkit.Await(t, holder, 40*time.Second, "holder"); res.Status != 200 {
		t.Errorf("holder: status %d err %v", res.Status, res.Err)
	}
	for i, ch := range admitted {
		if results[i] != nil {
			continue
		}
		if res := testkit.Await(t, ch, 40*time.Second, "admitted waiter"); res.Status != 200 {
			t.Errorf("admitted waiter %d: status %d err %v", i, res.Status, res.Err)
		}
	}
}

// TestMultiKeyWaiterNotStarvedByLocalChain: a request for keys {a,b} that
// waits behind a steady stream of requests for {a} in the same instance
// gets its turn. Before, the {a} holders handed the lease on locally and
// renewed their block of tokens (no other instance waited), so a was never
// released in Redis and the {a,b} waiter timed out.
func TestMultiKeyWaiterNotStarvedByLocalChain(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.K1}","{http.request.header.K2}"],"wait":"10s","ttl":"5s"}`, r.Addr))
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		time.Sleep(5 * time.Millisecond)
		return nil
	})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var served atomic.Int64
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if resp, _ := get(t, srv.URL+"/", "K1", "a", "K2", "a"); resp != nil && resp.StatusCode == 200 {
					served.Add(1)
				}
			}
		}()
	}
	defer func() { close(stop); wg.Wait() }()
	if !waitFor(10*time.Second, func() bool { return served.Load() >= 20 }) {
		t.Fatal("the {a} stream did not get going")
	}
	start := time.Now()
	resp, body := get(t, srv.URL+"/", "K1", "a", "K2", "b")
	if resp == nil || resp.StatusCode != 200 {
		t.Fatalf("{a,b} request behind a stream of {a}: %v %q after %v, want 200", resp, body, time.Since(start))
	}
	if n := served.Load(); n < 20 {
		t.Fatalf("only %d {a} requests served", n)
	}
}

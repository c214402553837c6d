package redislock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestLockMutualExclusionTwoInstances: two handler instances with separate
// Redis clients (so separate pools, local queues and instance ids) and 240
// concurrent requests on 4 keys; the upstream never sees two holders of a
// key, and fencing tokens strictly increase in the order it sees them.
func TestLockMutualExclusionTwoInstances(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := testkit.NewExclusivityUpstream(2 * time.Millisecond)
	a := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"timeout":"2s","wait":"60s"}`, r.Addr))
	b := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"timeout":"3s","wait":"60s"}`, r.Addr))
	if lockInstanceID(a) == lockInstanceID(b) {
		t.Fatal("instances share a domain; want separate clients")
	}
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
	var wg sync.WaitGroup
	var failed atomic.Int32
	for i := 0; i < 240; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			base := sa.URL
			if i%2 == 1 {
				base = sb.URL
			}
			resp, body := get(t, fmt.Sprintf("%s/key%d", base, i%4))
			if resp == nil || resp.StatusCode != 200 {
				failed.Add(1)
				t.Errorf("request %d: %v %s", i, resp, body)
			}
		}(i)
	}
	wg.Wait()
	up.Check(t)
	if up.Served() != 240 {
		t.Fatalf("served %d, want 240", up.Served())
	}
}

// TestLockWaitZeroAndTimeout: wait 0 answers 423 at once with Retry-After
// from the holder's lease; a 300ms wait runs out with 423.
func TestLockWaitZeroAndTimeout(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	holdUp := func(w http.ResponseWriter, req *http.Request) error {
		entered <- struct{}{}
		<-release
		return nil
	}
	holder := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"ttl":"5s"}`, r.Addr)), holdUp)
	done := make(chan struct{})
	go func() { defer close(done); get(t, holder.URL+"/job") }()
	defer func() { close(release); <-done }()
	recvWithin(t, entered, 15*time.Second, "the holder reaching the upstream")

	fast := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":0}`, r.Addr)), okHandler)
	start := time.Now()
	resp, _ := get(t, fast.URL+"/job")
	if resp.StatusCode != http.StatusLocked {
		t.Fatalf("wait 0: status %d, want 423", resp.StatusCode)
	}
	if time.Since(start) > 2*time.Second {
		t.Errorf("wait 0 took %s; want an immediate answer", time.Since(start))
	}
	ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > 5 {
		t.Errorf("Retry-After %q: want whole seconds in 1..5 (holder lease 5s)", resp.Header.Get("Retry-After"))
	}

	short := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"300ms","status":429}`, r.Addr)), okHandler)
	start = time.Now()
	resp, _ = get(t, short.URL+"/job")
	if resp.StatusCode != 429 {
		t.Fatalf("wait 300ms: status %d, want the configured 429", resp.StatusCode)
	}
	if el := time.Since(start); el < 300*time.Millisecond {
		t.Errorf("answered after %s, before the 300ms wait ran out", el)
	}
	if resp.Header.Get("Retry-After") == "" {
		t.Error("no Retry-After")
	}
}

// TestLockAutoExtend: a 1.5s lease is kept alive through a 3.5s upstream
// (more than two leases long) while a second request waits; the second never
// overlaps the first.
func TestLockAutoExtend(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := testkit.NewExclusivityUpstream(3500 * time.Millisecond)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"ttl":"1500ms","wait":"30s","timeout":"3s"}`, r.Addr))
	srv := handlerServer(t, h, up.ServeHTTP)
	var wg sync.WaitGroup
	starts := make([]time.Time, 2)
	ends := make([]time.Time, 2)
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if i == 1 {
				time.Sleep(200 * time.Millisecond)
			}
			starts[i] = time.Now()
			resp, body := get(t, srv.URL+"/slow")
			ends[i] = time.Now()
			if resp == nil || resp.StatusCode != 200 {
				t.Errorf("request %d: %v %s", i, resp, body)
			}
		}(i)
	}
	wg.Wait()
	up.Check(t)
	// Whichever got the lock first (the 200 ms head start is no promise on
	// a loaded machine), the other ended a whole hold later.
	if d := ends[1].Sub(ends[0]).Abs(); d < 3000*time.Millisecond {
		t.Errorf("the requests ended %s apart; the second should have waited for the 3.5s holder", d)
	}
}

// TestLockRedisDownThenUp: Redis down at start → 503 (fail_open: 200
// without a lock); once Redis starts, 200 with a lock, without a reload.
func TestLockRedisDownThenUp(t *testing.T) {
	t.Parallel()
	port := freePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	var lastToken atomic.Value
	lastToken.Store("")
	up := func(w http.ResponseWriter, r *http.Request) error {
		lastToken.Store(r.Header.Get("Lock-Fencing-Token"))
		return nil
	}
	closed := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"]}`, addr)), up)
	open := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"fail_open":true,"timeout":"400ms"}`, addr)), up)

	start := time.Now()
	resp, body := get(t, closed.URL+"/x", "Lock-Fencing-Token", "999")
	if resp.StatusCode != 503 {
		t.Fatalf("redis down: status %d (%s), want 503", resp.StatusCode, body)
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("503 took %s", time.Since(start))
	}
	resp, _ = get(t, open.URL+"/x", "Lock-Fencing-Token", "999")
	if resp.StatusCode != 200 {
		t.Fatalf("fail_open: status %d, want 200", resp.StatusCode)
	}
	if tok := lastToken.Load().(string); tok != "" {
		t.Errorf("fail_open passed a client-supplied fencing token %q upstream; want none", tok)
	}

	startRedisOnPort(t, port)
	resp, body = get(t, closed.URL+"/x")
	if resp.StatusCode != 200 {
		t.Fatalf("after redis started: status %d (%s), want 200", resp.StatusCode, body)
	}
	if tok, err := strconv.ParseInt(lastToken.Load().(string), 10, 64); err != nil || tok <= 0 {
		t.Errorf("fencing token %q, want a token from Redis", lastToken.Load())
	}
}

// TestLockWaiterDisconnectLeavesNothingHeld: a waiter whose client goes away
// stops waiting at once; the next request gets the lock as soon as the
// holder ends.
func TestLockWaiterDisconnectLeavesNothingHeld(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	release := make(chan struct{})
	openRelease := closer(release) // a failure before the planned close must not leave a handler blocked
	defer openRelease()
	entered := make(chan string, 4)
	up := func(w http.ResponseWriter, req *http.Request) error {
		entered <- req.URL.Query().Get("who")
		if req.URL.Query().Get("who") == "holder" {
			<-release
		}
		return nil
	}
	// Long backoff: the next request must be woken by the release, not a poll.
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"30s","backoff_min":"5s","backoff_max":"5s"}`, r.Addr))
	srv := handlerServer(t, h, up)
	go get(t, srv.URL+"/k?who=holder")
	if w := recvWithin(t, entered, 15*time.Second, "the holder reaching the upstream"); w != "holder" {
		t.Fatalf("entered %s", w)
	}
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL+"/k?who=quitter", nil)
		_, err := http.DefaultClient.Do(req)
		gone <- err
	}()
	awaitWaiters(t, h, "/k", 1) // the quitter is queued
	cancel()
	recvWithin(t, gone, 15*time.Second, "the quitter's answer")
	// The quitter must leave the queue: wait until no local waiter remains.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if lockWaitersFor(h, "/k") == 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := lockWaitersFor(h, "/k"); n != 0 {
		t.Fatalf("%d waiters still queued after the client went away", n)
	}
	nextDone := make(chan *http.Response, 1)
	go func() { resp, _ := get(t, srv.URL+"/k?who=next"); nextDone <- resp }()
	awaitWaiters(t, h, "/k", 1) // next is queued
	releasedAt := time.Now()
	openRelease()
	if w := recvWithin(t, entered, 15*time.Second, "the next request reaching the upstream"); w != "next" {
		t.Fatalf("after the holder, %q entered; want next", w)
	}
	if el := time.Since(releasedAt); el > 2*time.Second {
		t.Errorf("next request got the lock %s after the release; want at once (backoff is 5s)", el)
	}
	if resp := recvWithin(t, nextDone, 15*time.Second, "the next request's answer"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("next: %v", resp)
	}
}

// recvWithin receives from ch, failing the test when nothing comes within
// d (a request that never reached its upstream, say), so a test never hangs.
// Call it from the test's goroutine.
// closer returns a func that closes ch once, however often it is called: a
// test defers it, so that a failure before the planned close cannot leave a
// handler blocked on ch (the test server's Close waits for it).
func closer(ch chan struct{}) func() {
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func recvWithin[T any](t testing.TB, ch <-chan T, d time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(d):
		t.Fatalf("%s: nothing within %s", what, d)
		var zero T
		return zero
	}
}

// awaitWaiters waits until at least n requests of h wait here for the
// rendered key (the state itself, instead of a sleep that hopes for it).
func awaitWaiters(t testing.TB, h *RedisLock, rendered string, n int) {
	t.Helper()
	if !waitFor(15*time.Second, func() bool { return lockWaitersFor(h, rendered) >= n }) {
		t.Fatalf("%d of %d waiters for %s queued within 15s", lockWaitersFor(h, rendered), n, rendered)
	}
}

// lockWaitersFor counts this instance's local waiters for one rendered key.
func lockWaitersFor(h *RedisLock, rendered string) int {
	w, _ := h.locker.Local(shared.StoredKey(h.Prefix, rendered))
	return w
}

// TestLockMultiKeyOppositeOrder: requests naming the same two keys in
// opposite order never deadlock, and are mutually exclusive.
func TestLockMultiKeyOppositeOrder(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	var inflight, maxIn atomic.Int32
	up := func(w http.ResponseWriter, req *http.Request) error {
		n := inflight.Add(1)
		if n > maxIn.Load() {
			maxIn.Store(n)
		}
		time.Sleep(time.Millisecond)
		inflight.Add(-1)
		return nil
	}
	ab := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.A}","{http.request.header.B}"],"wait":"30s","timeout":"2s"}`, r.Addr)), up)
	ba := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.B}","{http.request.header.A}"],"wait":"30s","timeout":"3s"}`, r.Addr)), up)
	var wg sync.WaitGroup
	for i := 0; i < 60; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			srv, a, b := ab, "x", "y"
			if i%2 == 1 {
				srv, a, b = ba, "y", "x"
			}
			resp, body := get(t, srv.URL+"/", "A", a, "B", b)
			if resp == nil || resp.StatusCode != 200 {
				t.Errorf("request %d: %v %s", i, resp, body)
			}
		}(i)
	}
	wg.Wait()
	if maxIn.Load() != 1 {
		t.Fatalf("%d holders at once", maxIn.Load())
	}
}

// TestLockMultiKeyFencing: one token serves a key set, and later tokens of
// each single key are still higher.
func TestLockMultiKeyFencing(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	var tok atomic.Value
	up := func(w http.ResponseWriter, req *http.Request) error {
		tok.Store(req.Header.Get("Lock-Fencing-Token"))
		return nil
	}
	single := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.A}"]}`, r.Addr)), up)
	multi := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.A}","{http.request.header.B}"]}`, r.Addr)), up)
	// Each request must have reached the upstream, or tok is stale.
	send := func(url string, hdr ...string) int64 {
		t.Helper()
		if resp, body := get(t, url, hdr...); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("%s %v: %v %q", url, hdr, resp, body)
		}
		n, _ := strconv.ParseInt(tok.Load().(string), 10, 64)
		return n
	}
	var b int64
	for i := 0; i < 5; i++ {
		b = send(single.URL+"/", "A", "b") // raise b's counter
	}
	m := send(multi.URL+"/", "A", "a", "B", "b")
	s := send(single.URL+"/", "A", "a")
	if b <= 0 || m <= b || s <= m {
		t.Fatalf("key b alone %d, then a and b %d (want > %d), then key a alone %d (want > %d)", b, m, b, s, m)
	}
}

// TestLockKeyRendering: an empty key or one with a placeholder unknown at
// request time is a 400; a very long key is stored hashed; placeholders are
// set for later handlers; a client-sent fencing header is replaced.
func TestLockKeyRendering(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	var seen sync.Map
	up := func(w http.ResponseWriter, req *http.Request) error {
		repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		for _, p := range []string{"http.redis_lock.key", "http.redis_lock.fencing_token", "http.redis_lock.wait_ms"} {
			v, _ := repl.GetString(p)
			seen.Store(p, v)
		}
		seen.Store("header", req.Header.Get("Lock-Fencing-Token"))
		return nil
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["user:{http.request.header.X-User-ID}"]}`, r.Addr))
	srv := handlerServer(t, h, up)
	resp, _ := get(t, srv.URL+"/", "X-User-ID", "alice", "Lock-Fencing-Token", "999999")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if v, _ := seen.Load("http.redis_lock.key"); v != "user:alice" {
		t.Errorf("key placeholder %q", v)
	}
	tokVal, _ := seen.Load("http.redis_lock.fencing_token")
	if n, err := strconv.ParseInt(fmt.Sprint(tokVal), 10, 64); err != nil || n <= 999999 {
		t.Errorf("fencing_token placeholder %q, want a token (Redis time in µs or above)", tokVal)
	}
	if v, _ := seen.Load("header"); v != tokVal {
		t.Errorf("fencing header %q, want the token %q: the client's value must be replaced", v, tokVal)
	}
	if v, _ := seen.Load("http.redis_lock.wait_ms"); v == "" {
		t.Error("wait_ms placeholder empty")
	}

	empty := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.X-User-ID}"]}`, r.Addr)), okHandler)
	if resp, _ := get(t, empty.URL+"/"); resp.StatusCode != 400 {
		t.Errorf("empty key: status %d, want 400", resp.StatusCode)
	}
	unknown := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.auth.user.id}"]}`, r.Addr)), okHandler)
	if resp, _ := get(t, unknown.URL+"/"); resp.StatusCode != 400 {
		t.Errorf("unknown placeholder: status %d, want 400", resp.StatusCode)
	}

	long := strings.Repeat("x", 300)
	holdCh := make(chan struct{})
	openHoldCh := closer(holdCh) // a failure before the planned close must not leave a handler blocked
	defer openHoldCh()
	entered := make(chan struct{})
	hl := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.K}"]}`, r.Addr)), func(w http.ResponseWriter, req *http.Request) error {
		close(entered)
		<-holdCh
		return nil
	})
	go get(t, hl.URL+"/", "K", long)
	recvWithin(t, entered, 30*time.Second, "the upstream entered")
	keys, err := r.Client().Keys(context.Background(), "caddy:lock:*").Result()
	openHoldCh()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if len(k) > 300 {
			t.Errorf("Redis key of %d bytes; a key over 200 bytes must be stored hashed", len(k))
		}
		if strings.Contains(k, "sha256:") {
			return
		}
	}
	t.Errorf("no hashed key among %v", keys)
}

// TestLockReleasedOnErrorAndPanic: the lock is released when the next
// handler returns an error or panics.
func TestLockReleasedOnErrorAndPanic(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":0}`, r.Addr))
	keys := []string{shared.StoredKey(h.Prefix, "/p")}
	rec := func(next caddyhttp.HandlerFunc) (err error, p any) {
		defer func() { p = recover() }()
		req, _ := http.NewRequest("GET", "http://x/p", nil)
		repl := caddyhttp.NewTestReplacer(req)
		req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
		return h.ServeHTTP(&nopWriter{h: http.Header{}}, req, next), nil
	}
	err, _ := rec(func(w http.ResponseWriter, r *http.Request) error { return errors.New("boom") })
	if err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("error not passed through: %v", err)
	}
	assertFree(t, h, keys)
	_, p := rec(func(w http.ResponseWriter, r *http.Request) error { panic("kaboom") })
	if p == nil {
		t.Fatal("panic swallowed")
	}
	assertFree(t, h, keys)
}

func assertFree(t *testing.T, h *RedisLock, keys []string) {
	t.Helper()
	l, err := h.locker.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatalf("lock still held: %v", err)
	}
	l.Release()
}

type nopWriter struct {
	h    http.Header
	code int
}

func (w *nopWriter) Header() http.Header         { return w.h }
func (w *nopWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *nopWriter) WriteHeader(c int)           { w.code = c }

// TestLockOnLost: when an extension finds the lease gone, on_lost cancel
// cancels the request (503 before the response starts) and counts it;
// on_lost continue lets it finish.
func TestLockOnLost(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, mode := range []string{"cancel", "continue"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			entered := make(chan struct{})
			var canceled atomic.Bool
			up := func(w http.ResponseWriter, req *http.Request) error {
				close(entered)
				select {
				case <-req.Context().Done():
					canceled.Store(true)
					return req.Context().Err()
				case <-time.After(1200 * time.Millisecond):
				}
				return nil
			}
			h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"ttl":"300ms","on_lost":"%s","prefix":"lost:%s:"}`, r.Addr, mode, mode))
			lostBefore := lostCount(h.label)
			srv := handlerServer(t, h, up)
			done := make(chan *http.Response, 1)
			go func() { resp, _ := get(t, srv.URL+"/l"); done <- resp }()
			recvWithin(t, entered, 30*time.Second, "the upstream entered")
			// Steal the lease: delete the lock key behind the holder's back.
			if err := r.Client().Del(context.Background(), shared.StoredKey(h.Prefix, "/l")).Err(); err != nil {
				t.Fatal(err)
			}
			resp := recvWithin(t, done, 30*time.Second, "the answer")
			// Other tests run in parallel and may lose leases too: at least one more.
			if d := lostCount(h.label) - lostBefore; d < 1 {
				t.Errorf("caddy_redis_lock_lost_total rose by %v, want at least 1", d)
			}
			if mode == "cancel" {
				if resp.StatusCode != 503 || !canceled.Load() {
					t.Fatalf("cancel: status %d canceled=%v, want 503 and a canceled upstream", resp.StatusCode, canceled.Load())
				}
			} else if resp.StatusCode != 200 || canceled.Load() {
				t.Fatalf("continue: status %d canceled=%v, want 200, not canceled", resp.StatusCode, canceled.Load())
			}
		})
	}
}

// TestLockMaxWaitersAndPermits: permits lets n holders in at once; waiters
// beyond max_waiters are answered at once with status and Retry-After.
func TestLockMaxWaitersAndPermits(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	var inflight, maxIn atomic.Int32
	release := make(chan struct{})
	openRelease := closer(release) // a failure before the planned close must not leave a handler blocked
	defer openRelease()
	up := func(w http.ResponseWriter, req *http.Request) error {
		n := inflight.Add(1)
		defer inflight.Add(-1)
		for m := maxIn.Load(); n > m && !maxIn.CompareAndSwap(m, n); m = maxIn.Load() {
		}
		<-release
		return nil
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"permits":2,"max_waiters":2,"wait":"20s"}`, r.Addr))
	srv := handlerServer(t, h, up)
	results := make(chan int, 8)
	send := func() {
		go func() {
			resp, _ := get(t, srv.URL+"/sem")
			if resp == nil {
				results <- 0
				return
			}
			results <- resp.StatusCode
		}()
	}
	// 2 hold (permits), then 2 wait (max_waiters); a fifth is one too many.
	send()
	send()
	deadline := time.Now().Add(10 * time.Second)
	for inflight.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	send()
	send()
	for lockWaitersFor(h, "/sem") < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	resp, _ := get(t, srv.URL+"/sem")
	if resp.StatusCode != 423 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("over max_waiters: status %d Retry-After %q, want 423 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	openRelease()
	for i := 0; i < 4; i++ {
		if s := <-results; s != 200 {
			t.Errorf("status %d", s)
		}
	}
	if maxIn.Load() != 2 {
		t.Errorf("max holders at once %d, want permits=2", maxIn.Load())
	}
}

// TestLockFIFOWithinInstance: waiters of one key in one instance are
// served in arrival order.
func TestLockFIFOWithinInstance(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	var order []string
	var mu sync.Mutex
	release := make(chan struct{})
	openRelease := closer(release) // a failure before the planned close must not leave a handler blocked
	defer openRelease()
	first := make(chan struct{})
	up := func(w http.ResponseWriter, req *http.Request) error {
		who := req.URL.Query().Get("n")
		mu.Lock()
		order = append(order, who)
		mu.Unlock()
		if who == "0" {
			close(first)
			<-release
		}
		return nil
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"30s"}`, r.Addr))
	srv := handlerServer(t, h, up)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); get(t, srv.URL+"/f?n=0") }()
	recvWithin(t, first, 15*time.Second, "the first request reaching the upstream")
	for i := 1; i <= 5; i++ {
		wg.Add(1)
		go func(i int) { defer wg.Done(); get(t, fmt.Sprintf("%s/f?n=%d", srv.URL, i)) }(i)
		// Each one queued before the next arrives.
		deadline := time.Now().Add(5 * time.Second)
		for lockWaitersFor(h, "/f") < i && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
	openRelease()
	wg.Wait()
	if got := strings.Join(order, ","); got != "0,1,2,3,4,5" {
		t.Fatalf("service order %s, want 0,1,2,3,4,5", got)
	}
}

// TestLockLocalHandOff: on a hot key, one Redis acquisition serves several
// queued requests of the same instance in turn (the lease is handed on with
// the next reserved fencing token), so far fewer than 2 Redis calls per
// request are made, while exclusivity and increasing tokens hold.
func TestLockLocalHandOff(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := testkit.NewExclusivityUpstream(3 * time.Millisecond)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"60s","timeout":"5s"}`, r.Addr))
	// The first holder stays until the other 39 queue behind it, so they
	// contend however slowly a loaded machine starts them.
	var first sync.Once
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		first.Do(func() {
			deadline := time.Now().Add(20 * time.Second)
			for lockWaitersFor(h, "/hot") < 39 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
		})
		return up.ServeHTTP(w, req)
	})
	before := r.CommandCalls("evalsha") + r.CommandCalls("eval")
	hammerLock(t, 40, 40, srv.URL+"/hot")
	calls := r.CommandCalls("evalsha") + r.CommandCalls("eval") - before
	up.Check(t)
	if up.Served() != 40 {
		t.Fatalf("served %d", up.Served())
	}
	if calls >= 60 {
		t.Errorf("%d script calls for 40 contended requests; local hand-off should need far fewer than 2 per request", calls)
	}
	t.Logf("%d script calls for 40 requests", calls)
}

// lostCount reads caddy_redis_lock_lost_total of one handler.
func lostCount(handler string) float64 {
	return testkit.Count(shared.LockLostTotal.WithLabelValues(handler))
}

// TestLockSubscriptionsConstant: waiting on many keys uses one Pub/Sub
// subscription per Redis server per instance, not one per key.
func TestLockSubscriptionsConstant(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	release := make(chan struct{})
	openRelease := closer(release) // a failure before the planned close must not leave a handler blocked
	defer openRelease()
	var entered sync.WaitGroup
	up := func(w http.ResponseWriter, req *http.Request) error {
		if req.URL.Query().Get("hold") == "1" {
			entered.Done()
			<-release
		}
		return nil
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"30s"}`, r.Addr))
	srv := handlerServer(t, h, up)
	var wg sync.WaitGroup
	for k := 0; k < 20; k++ {
		entered.Add(1)
		wg.Add(2)
		go func(k int) { defer wg.Done(); get(t, fmt.Sprintf("%s/k%d?hold=1", srv.URL, k)) }(k)
		go func(k int) {
			defer wg.Done()
			time.Sleep(200 * time.Millisecond)
			get(t, fmt.Sprintf("%s/k%d", srv.URL, k))
		}(k)
	}
	allIn := make(chan struct{})
	go func() { entered.Wait(); close(allIn) }()
	select {
	case <-allIn:
	case <-time.After(20 * time.Second):
		openRelease()
		wg.Wait()
		t.Fatal("not every holder entered within 20s")
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		n := 0
		for k := 0; k < 20; k++ {
			n += lockWaitersFor(h, fmt.Sprintf("/k%d", k))
		}
		if n == 20 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The waiters subscribe in the background: wait until Redis confirms.
	ctx := context.Background()
	rc := r.Client()
	waitFor(5*time.Second, func() bool { return wakeSubscribers(rc) >= 1 })
	time.Sleep(100 * time.Millisecond) // room for a (wrong) second subscription
	chans, err := rc.PubSubChannels(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	subs, _ := rc.PubSubNumSub(ctx, lock.WakeChannel).Result()
	openRelease()
	wg.Wait()
	if len(chans) != 1 || chans[0] != lock.WakeChannel || subs[lock.WakeChannel] != 1 {
		t.Fatalf("20 keys waited on: channels %v, subscribers %v; want one channel %s with one subscriber", chans, subs, lock.WakeChannel)
	}
}

// TestLockRetryAfterFromHoldTimes: a duplicate of a job that takes about
// 1.5s is told to retry in about 2s, not in the auto-extended lease's 60s;
// with requests queued ahead (here or at other instances) it is told one
// p90 hold later for each, with no cap from the holder's lease; a holder
// past the p90 is known only by its lease; before any hold was seen, the
// lease is all there is.
func TestLockRetryAfterFromHoldTimes(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	entered := make(chan struct{}, 4)
	up := func(w http.ResponseWriter, req *http.Request) error {
		entered <- struct{}{}
		time.Sleep(1500 * time.Millisecond)
		return nil
	}
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"ttl":"60s","wait":"0s"`))
	srv := handlerServer(t, h, up)
	retry := func() int {
		t.Helper()
		resp, _ := get(t, srv.URL+"/job")
		if resp == nil || resp.StatusCode != 423 {
			t.Fatalf("duplicate: %v, want 423", resp)
		}
		n, err := strconv.Atoi(resp.Header.Get("Retry-After"))
		if err != nil {
			t.Fatalf("Retry-After %q", resp.Header.Get("Retry-After"))
		}
		return n
	}
	first := testkit.GoFetch(context.Background(), srv.URL+"/job")
	recvWithin(t, entered, 15*time.Second, "the first job reaching the upstream")
	if n := retry(); n < 55 || n > 60 {
		t.Errorf("no hold seen yet: Retry-After %d, want the remaining lease (~60)", n)
	}
	testkit.Await(t, first, 20*time.Second, "first job")
	second := testkit.GoFetch(context.Background(), srv.URL+"/job")
	recvWithin(t, entered, 15*time.Second, "the second job reaching the upstream")
	if n := retry(); n < 1 || n > 3 {
		t.Errorf("after one 1.5s hold: Retry-After %d, want about 2 (not the 60s lease)", n)
	}
	testkit.Await(t, second, 20*time.Second, "second job")

	// Two holds of ~1.5s seen; the release allowance is the timeout (500ms).
	p90, ok := h.holds.p90()
	if !ok || p90 < 1500*time.Millisecond {
		t.Fatalf("p90 of the holds seen: %s %v, want at least the 1.5s job", p90, ok)
	}
	allow := 500 * time.Millisecond
	cases := []struct {
		what             string
		lease, held      time.Duration
		ahead, elsewhere int
		want             time.Duration
	}{
		{"held 0.5s, 5 queued here, lease 4s left (no cap)", 4 * time.Second, 500 * time.Millisecond, 5, 0, 6*p90 - 500*time.Millisecond + allow},
		{"held 0.5s, 1 queued here, 2 instances waiting", 60 * time.Second, 500 * time.Millisecond, 1, 2, 4*p90 - 500*time.Millisecond + allow},
		{"grant unknown: as if just granted", 60 * time.Second, -1, 0, 0, p90 + allow},
		{"held past the p90: the lease left", 20 * time.Second, p90 + time.Second, 0, 0, 20*time.Second + allow},
	}
	for _, c := range cases {
		if est := h.estimateFree(lock.NewBusyError(ErrNotObtained, c.lease, c.held, c.ahead, c.elsewhere)); est != c.want {
			t.Errorf("%s: estimate %s, want %s (p90 %s)", c.what, est, c.want, p90)
		}
	}
}

// TestOnLostCancelNoAnswerWithoutTheLock: with on_lost cancel, a next
// handler that ignores its context (respond, file_server, a slow template)
// and writes after the lease was lost does not answer the client: its
// writes are dropped and the client gets 503, whichever way it writes (a
// header and a body, io.Copy through ReadFrom, a flush). Before, it went
// out as 200, produced without the lock.
func TestOnLostCancelNoAnswerWithoutTheLock(t *testing.T) {
	t.Parallel()
	writes := map[string]func(w http.ResponseWriter){
		"write": func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("written without the lock"))
		},
		"readfrom": func(w http.ResponseWriter) { _, _ = io.Copy(w, strings.NewReader("written without the lock")) },
		"flush":    func(w http.ResponseWriter) { _ = http.NewResponseController(w).Flush() },
	}
	for name, write := range writes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			entered := make(chan struct{})
			up := func(w http.ResponseWriter, req *http.Request) error {
				close(entered)
				<-req.Context().Done() // the loss cancels it; the handler goes on anyway
				w.Header().Set("Set-Cookie", "session=made-without-the-lock")
				w.Header().Set("Content-Length", "1000")
				write(w)
				return nil
			}
			h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"ttl":"300ms","on_lost":"cancel"}`, r.Addr))
			srv := handlerServer(t, h, up)
			type answer struct {
				resp *http.Response
				body string
			}
			done := make(chan answer, 1)
			go func() { resp, b := get(t, srv.URL+"/l"); done <- answer{resp, b} }()
			recvWithin(t, entered, 30*time.Second, "the upstream entered")
			if err := r.Client().Del(context.Background(), shared.StoredKey(h.Prefix, "/l")).Err(); err != nil {
				t.Fatal(err)
			}
			select {
			case a := <-done:
				if a.resp == nil || a.resp.StatusCode != http.StatusServiceUnavailable || strings.Contains(a.body, "without the lock") {
					t.Fatalf("after the lease was lost with on_lost cancel: %v %q, want 503", a.resp, a.body)
				}
				if c := a.resp.Header.Get("Set-Cookie"); c != "" {
					t.Fatalf("the 503 carries the route's Set-Cookie %q, set without the lock", c)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("no answer")
			}
		})
	}
}

// TestLockHandOffKeepsTokensFresh: a lease is handed on locally only while
// its block of fencing tokens is younger than the ttl. A token's floor is
// the Redis TIME its block was reserved at, and redis_fence refuses tokens
// older than its retain, so after a hold longer than the ttl (kept alive by
// auto-extension) the next holder gets a fresh token from Redis instead of
// the next of an aging block; after a short hold the lease is handed on.
func TestLockHandOffKeepsTokensFresh(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"ttl":"1s","wait":"20s","timeout":"5s"}`, r.Addr))
	tokens := make(chan int64, 4)
	release := make(chan struct{}, 3)
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		tok, err := strconv.ParseInt(req.Header.Get(DefaultFencingHeader), 10, 64)
		if err != nil {
			return err
		}
		tokens <- tok
		if req.URL.Query().Get("hold") != "" {
			<-release
		}
		return nil
	})
	for _, tc := range []struct {
		name    string
		hold    time.Duration
		handOff bool
	}{{"short hold", 50 * time.Millisecond, true}, {"hold past the ttl", 1500 * time.Millisecond, false}} {
		path := "/fresh-" + strings.ReplaceAll(tc.name, " ", "-")
		key := shared.StoredKey(h.Prefix, path)
		done := make(chan struct{}, 3)
		go func() { get(t, srv.URL+path+"?hold=1"); done <- struct{}{} }()
		<-tokens
		// Two wait behind the first holder, in this order: the second
		// takes the lock from Redis with a block of two tokens, the third
		// its lease from the second.
		for i, q := range []string{"?hold=1", ""} {
			go func() { get(t, srv.URL+path+q); done <- struct{}{} }()
			if !waitFor(15*time.Second, func() bool { w, _ := h.locker.Local(key); return w > i }) {
				t.Fatal("the waiters never queued")
			}
		}
		release <- struct{}{}
		second := <-tokens
		time.Sleep(tc.hold)
		release <- struct{}{}
		third := <-tokens
		for range 3 {
			<-done
		}
		handedOn := third == second+1
		if handedOn != tc.handOff {
			t.Errorf("%s: tokens %d then %d (handed on: %v), want handed on: %v", tc.name, second, third, handedOn, tc.handOff)
		}
		if !tc.handOff && third-second < tc.hold.Microseconds()*9/10 {
			t.Errorf("%s: the next token %d is not fresh: %d µs above the one before, the hold was %s", tc.name, third, third-second, tc.hold)
		}
	}
}

// TestFencingTokenSurvivesHopByHop: a client that lists the fencing header
// in Connection (to have reverse_proxy drop it as hop-by-hop) does not keep
// the token from the upstream: the lock takes the name out of Connection
// and keeps the client's other Connection options.
func TestFencingTokenSurvivesHopByHop(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri.path}"]`))
	got := make(chan [2]string, 1)
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		// What reverse_proxy does to the request's hop-by-hop headers.
		hdr := req.Header.Clone()
		conn := hdr.Values("Connection")
		for _, v := range conn {
			for _, opt := range strings.Split(v, ",") {
				hdr.Del(strings.TrimSpace(opt))
			}
		}
		got <- [2]string{hdr.Get(DefaultFencingHeader), strings.Join(conn, ",")}
		return nil
	})
	req, _ := http.NewRequest("GET", srv.URL+"/hop", nil)
	req.Header.Set("Connection", "lock-fencing-token, X-Other")
	req.Header.Set(DefaultFencingHeader, "1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	g := <-got
	if tok, _ := strconv.ParseInt(g[0], 10, 64); tok <= 1 {
		t.Fatalf("the upstream got token %q (Connection %q); want the lock's", g[0], g[1])
	}
	if !strings.Contains(g[1], "X-Other") || strings.Contains(strings.ToLower(g[1]), "lock-fencing-token") {
		t.Errorf("Connection as the next handler saw it: %q; want X-Other kept and the fencing header gone", g[1])
	}
}

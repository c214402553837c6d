package redislock

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

const replayCfg = `"keys":["{http.request.header.X-User}:{http.request.header.Idempotency-Key}"],"replay":"30s","wait":"20s"`

// TestReplayDuplicatesRunOnce: concurrent duplicates over two instances
// reach the upstream exactly once and all get the same status, body and
// headers (Set-Cookie included, hop-by-hop headers not); a late duplicate
// is replayed too; another user with the same Idempotency-Key runs; the
// same key with another body is 422 and never reaches the upstream.
func TestReplayDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := new(testkit.OrderUpstream)
	a := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"timeout":"2s"`))
	b := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"timeout":"3s"`))
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)

	type answer struct {
		status int
		hdr    http.Header
		body   string
		err    error
	}
	const n = 20
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			base := sa.URL
			if i%2 == 1 {
				base = sb.URL
			}
			st, h, body, err := testkit.Post(base+"/orders?sleep=300ms", `{"sku":"a"}`, "X-User", "alice", "Idempotency-Key", "k1")
			answers[i] = answer{st, h, body, err}
		}(i)
	}
	wg.Wait()
	if c := up.Calls.Load(); c != 1 {
		t.Fatalf("%d concurrent duplicates over two instances made %d upstream calls, want 1", n, c)
	}
	replays := 0
	for i, ans := range answers {
		if ans.err != nil || ans.status != 201 || ans.body != "order #1" || ans.hdr.Get("X-Order") != "1" || ans.hdr.Get("Set-Cookie") != "session=s1" {
			t.Fatalf("answer %d: %d %q %v (X-Order %q, Set-Cookie %q), want 201 \"order #1\"", i, ans.status, ans.body, ans.err, ans.hdr.Get("X-Order"), ans.hdr.Get("Set-Cookie"))
		}
		if ans.hdr.Get(HeaderIdempotentReplayed) == "true" {
			replays++
			if ans.hdr.Get("X-Hop") != "" {
				t.Errorf("answer %d replayed a hop-by-hop header", i)
			}
		}
	}
	if replays != n-1 {
		t.Errorf("%d answers marked %s, want %d", replays, HeaderIdempotentReplayed, n-1)
	}

	// A late duplicate, in either instance.
	st, h, body, _ := testkit.Post(sb.URL+"/orders?sleep=300ms", `{"sku":"a"}`, "X-User", "alice", "Idempotency-Key", "k1")
	if st != 201 || body != "order #1" || h.Get(HeaderIdempotentReplayed) != "true" || up.Calls.Load() != 1 {
		t.Fatalf("late duplicate: %d %q replayed=%q, upstream calls %d", st, body, h.Get(HeaderIdempotentReplayed), up.Calls.Load())
	}
	// The same key with another body.
	if st, _, _, _ := testkit.Post(sa.URL+"/orders?sleep=300ms", `{"sku":"b"}`, "X-User", "alice", "Idempotency-Key", "k1"); st != 422 || up.Calls.Load() != 1 {
		t.Fatalf("another request under a used key: %d (upstream calls %d), want 422 and no call", st, up.Calls.Load())
	}
	// Another user with the same Idempotency-Key is another key.
	if st, _, body, _ := testkit.Post(sa.URL+"/orders", `{"sku":"a"}`, "X-User", "bob", "Idempotency-Key", "k1"); st != 201 || body != "order #2" {
		t.Fatalf("bob with alice's Idempotency-Key: %d %q, want his own order #2", st, body)
	}
}

// TestReplayNotStored: a 5xx, a body over replay_max, a streamed response
// and an answer the route broke off are not stored. A 5xx the route wrote
// says the run failed: the next request runs the route. The others leave
// the key in doubt (the upstream may have acted): the next request with
// the key gets 409 and the route runs once (never twice).
func TestReplayNotStored(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, tc := range []struct {
		name, query string
		calls       int64
		second      int // the duplicate's status
	}{
		{"5xx", "status=503", 2, 503},
		{"over replay_max", "size=100", 1, http.StatusConflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			up := new(testkit.OrderUpstream)
			h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"replay_max":64,"prefix":"ns:`+tc.name+`:"`))
			srv := handlerServer(t, h, up.ServeHTTP)
			var st int
			for i := 1; i <= 2; i++ {
				var hdr http.Header
				var err error
				st, hdr, _, err = testkit.Post(srv.URL+"/o?"+tc.query, "x", "X-User", "u", "Idempotency-Key", "k")
				if err != nil || hdr.Get(HeaderIdempotentReplayed) != "" {
					t.Fatalf("request %d: %v, replayed %q: a %s response must not be replayed", i, err, hdr.Get(HeaderIdempotentReplayed), tc.name)
				}
			}
			if c := up.Calls.Load(); c != tc.calls || st != tc.second {
				t.Fatalf("%d upstream calls, the duplicate got %d; want %d calls and %d (%s not stored)", c, st, tc.calls, tc.second, tc.name)
			}
		})
	}
	t.Run("streamed", func(t *testing.T) {
		t.Parallel()
		// Server-sent events are a stream: not stored, and the key is in
		// doubt (409 for the duplicate). A flushed answer that ends is
		// stored (reverse_proxy flushes every answer without a
		// Content-Length).
		for _, tc := range []struct {
			contentType string
			second      string
		}{{"text/event-stream", "409"}, {"application/json", "part and the rest"}} {
			var calls atomic.Int64
			h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"prefix":"ns:streamed:`+tc.contentType+`:"`))
			srv := handlerServer(t, h, func(w http.ResponseWriter, r *http.Request) error {
				calls.Add(1)
				w.Header().Set("Content-Type", tc.contentType)
				_, _ = io.WriteString(w, "part")
				http.NewResponseController(w).Flush()
				_, _ = io.WriteString(w, " and the rest")
				return nil
			})
			var bodies []string
			for i := 0; i < 2; i++ {
				st, _, body, _ := testkit.Post(srv.URL+"/s", "x", "X-User", "u", "Idempotency-Key", "k")
				if st == http.StatusConflict {
					body = "409"
				}
				bodies = append(bodies, body)
			}
			if c := calls.Load(); c != 1 || bodies[1] != tc.second {
				t.Fatalf("%s, flushed: %d calls, second answer %q; want 1 call and %q", tc.contentType, c, bodies[1], tc.second)
			}
		}
	})
	t.Run("the route broke off", func(t *testing.T) {
		t.Parallel()
		// An answer the route itself failed to finish (reverse_proxy returns
		// an error when the upstream breaks off) is aborted: not stored, and
		// the key is in doubt (the upstream acted, or may have). A GET, which
		// may run again, does.
		var calls atomic.Int64
		h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"prefix":"ns:brokeoff:"`))
		srv := handlerServer(t, h, func(w http.ResponseWriter, r *http.Request) error {
			if calls.Add(1) == 1 {
				w.WriteHeader(200)
				_, _ = io.WriteString(w, "half")
				return io.ErrUnexpectedEOF
			}
			_, _ = io.WriteString(w, "second")
			return nil
		})
		testkit.Post(srv.URL+"/g", "x", "X-User", "u", "Idempotency-Key", "k")
		if st, _, _, _ := testkit.Post(srv.URL+"/g", "x", "X-User", "u", "Idempotency-Key", "k"); st != http.StatusConflict || calls.Load() != 1 {
			t.Fatalf("after a broken-off answer: %d, %d route runs; want 409 and 1 run", st, calls.Load())
		}
		if _, hdr, body, _ := testkit.SendBody("GET", srv.URL+"/g", "", "X-User", "u", "Idempotency-Key", "k"); body != "second" || hdr.Get(HeaderIdempotentReplayed) != "" {
			t.Fatalf("a GET after a broken-off answer: %q replayed=%q, want the route to run again", body, hdr.Get(HeaderIdempotentReplayed))
		}
	})
	t.Run("holder's client went away", func(t *testing.T) {
		t.Parallel()
		// The answer outlives the client: the route runs to its end, its
		// writes to the gone client are swallowed, and the waiter is
		// replayed the whole answer.
		var calls atomic.Int64
		started := make(chan struct{}, 4)
		h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"timeout":"5s","prefix":"ns:gone:"`))
		clients := make(chan context.Context, 4) // the client's own context, seen before the lock
		srv := handlerServer(t, seeClient{h, clients}, func(w http.ResponseWriter, req *http.Request) error {
			if calls.Add(1) == 1 {
				started <- struct{}{}
				w.WriteHeader(200)
				_, _ = io.WriteString(w, "first ")
				<-(<-clients).Done() // the client goes away mid-response
				for i := 0; i < 3; i++ {
					if _, err := io.WriteString(w, "and more "); err != nil {
						return err // a write error would abort the route
					}
					_ = http.NewResponseController(w).Flush()
				}
				if req.Context().Err() != nil {
					return req.Context().Err()
				}
				return nil
			}
			_, _ = io.WriteString(w, "second")
			return nil
		})
		leave := startImpatient(t, srv.URL+"/g", started)
		waiter := make(chan string, 1)
		go func() {
			_, hdr, body, _ := testkit.Post(srv.URL+"/g", "x", "X-User", "u", "Idempotency-Key", "k")
			waiter <- body + "|" + hdr.Get(HeaderIdempotentReplayed)
		}()
		leave()
		select {
		case got := <-waiter:
			if got != "first and more and more and more |true" {
				t.Fatalf("waiter got %q, want the whole first answer, replayed", got)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("waiter not answered")
		}
		if c := calls.Load(); c != 1 {
			t.Fatalf("%d route runs, want 1", c)
		}
	})
}

// seeClient passes each request's own context (the client's, before the
// lock detaches the route from it) to a channel.
type seeClient struct {
	mw caddyhttp.MiddlewareHandler
	ch chan context.Context
}

func (s seeClient) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	select {
	case s.ch <- r.Context():
	default:
	}
	return s.mw.ServeHTTP(w, r, next)
}

// TestReplayCoalescesGets: 30 concurrent GETs of one URI cost one upstream
// call (request coalescing with a short replay).
func TestReplayCoalescesGets(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := new(testkit.OrderUpstream)
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"2s","wait":"20s"`))
	srv := handlerServer(t, h, up.ServeHTTP)
	var wg sync.WaitGroup
	var bad atomic.Int32
	for i := 0; i < 30; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, body := get(t, srv.URL+"/catalog?page=1&sleep=200ms&status=200")
			if resp == nil || resp.StatusCode != 200 || body != "order #1" {
				bad.Add(1)
			}
		}()
	}
	wg.Wait()
	if c := up.Calls.Load(); c != 1 || bad.Load() != 0 {
		t.Fatalf("30 concurrent GETs: %d upstream calls, %d bad answers; want 1 call, all the same answer", c, bad.Load())
	}
}

// TestReplayLargeRequestBody: a request body over replay_max is answered
// 413 and never reaches the upstream, with any fingerprint; with
// `fingerprint off` another body gets the stored answer.
func TestReplayLargeRequestBody(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := new(testkit.OrderUpstream)
	h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"replay_max":16`))
	srv := handlerServer(t, h, up.ServeHTTP)
	if st, _, _, _ := testkit.Post(srv.URL+"/big", strings.Repeat("b", 17), "X-User", "u", "Idempotency-Key", "k"); st != 413 || up.Calls.Load() != 0 {
		t.Fatalf("body over replay_max: %d (upstream calls %d), want 413 and no call", st, up.Calls.Load())
	}
	// Under replay the body is always buffered (a client that goes away
	// mid-upload cannot cut the route's copy short), whatever the
	// fingerprint: over replay_max it is 413 with fingerprint off too.
	off := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"replay_max":16,"fingerprint":["off"],"prefix":"off:"`))
	so := handlerServer(t, off, up.ServeHTTP)
	if st, _, _, _ := testkit.Post(so.URL+"/big", strings.Repeat("b", 17), "X-User", "u", "Idempotency-Key", "k"); st != 413 || up.Calls.Load() != 0 {
		t.Fatalf("fingerprint off, body over replay_max: %d (upstream calls %d), want 413 and no call", st, up.Calls.Load())
	}
	if st, _, _, _ := testkit.Post(so.URL+"/big", "a body", "X-User", "u", "Idempotency-Key", "k"); st != 201 {
		t.Fatalf("fingerprint off: %d, want 201", st)
	}
	if st, hdr, _, _ := testkit.Post(so.URL+"/big", "another body", "X-User", "u", "Idempotency-Key", "k"); st != 201 || hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatalf("fingerprint off, another body: %d replayed=%q, want the stored answer", st, hdr.Get(HeaderIdempotentReplayed))
	}
}

// TestReplayConfigErrors: replay with permits > 1, several keys or a
// Redlock quorum is refused, in the Caddyfile (with the line) and in JSON.
func TestReplayConfigErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, block, want string }{
		{"permits", "replay 1m\n\tpermits 2", "permits 2"},
		{"keys", "replay 1m\n\tkey a\n\tkey b", "one key"},
		{"redlock", "replay 1m\n\tredis 127.0.0.1:1 127.0.0.1:2 127.0.0.1:3", "Redlock"},
		{"replay_max", "replay_max lots", "replay_max"},
		{"fingerprint", "fingerprint off {http.request.uri}", "off stands alone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(RedisLock)
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\t" + tc.block + "\n}"))
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "redis_lock") || !strings.Contains(err.Error(), ":") {
				t.Fatalf("Caddyfile: %v, want an error naming redis_lock and %q", err, tc.want)
			}
		})
	}
	for _, cfg := range []string{`{"replay":"1m","permits":2}`, `{"replay":"1m","keys":["a","b"]}`, `{"replay":"1m","redis":["127.0.0.1:1","127.0.0.1:2","127.0.0.1:3"]}`} {
		h := new(RedisLock)
		if err := json.Unmarshal([]byte(cfg), h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "replay") {
			t.Errorf("JSON %s: %v, want a replay error", cfg, err)
		}
	}
}

// BenchmarkReplayMemory prints the Redis memory of one stored response
// (MEMORY USAGE of the replay key) for a few body sizes:
//
//	go test -run '^$' -bench ReplayMemory -benchtime 1x -v .
func BenchmarkReplayMemory(b *testing.B) {
	r := startRedis(b)
	h := provisionLock(b, testkit.LockConfig(r.Addr, `"keys":["{http.request.header.K}"],"replay":"1m","replay_max":1048576`))
	for _, size := range []int{0, 100, 1000, 10000, 100000} {
		up := func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(201)
			_, _ = io.WriteString(w, strings.Repeat("x", size))
			return nil
		}
		srv := handlerServer(b, h, up)
		key := "m" + strconv.Itoa(size)
		if st, _, _, err := testkit.Post(srv.URL+"/o", "x", "K", key); err != nil || st != 201 {
			b.Fatalf("store: %d %v", st, err)
		}
		// The release stores the answer just after the response.
		var n int64
		var err error
		waitFor(5*time.Second, func() bool {
			n, err = r.Client().MemoryUsage(context.Background(), lock.ReplayKey(shared.StoredKey(h.Prefix, key)), 0).Result()
			return err == nil
		})
		if err != nil {
			b.Fatal(err)
		}
		b.Logf("stored response with a %6d-byte body and its headers: %7d bytes of Redis memory", size, n)
	}
}

// TestReplayWithSyncReplicas: `replay` works with `sync_replicas` too (the
// acquire that waits for replicas also looks for the stored answer): the
// same idempotency key reaches the upstream once, and the retry is replayed.
func TestReplayWithSyncReplicas(t *testing.T) {
	t.Parallel()
	primary := startRedis(t)
	_ = startRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	waitReplicaOnline(t, primary.Client(), 1)
	up := new(testkit.OrderUpstream)
	h := provisionLock(t, testkit.LockConfig(primary.Addr, replayCfg+`,"sync_replicas":1,"timeout":"2s"`))
	srv := handlerServer(t, h, up.ServeHTTP)
	var bodies []string
	for i := 0; i < 2; i++ {
		st, hdr, body, err := testkit.Post(srv.URL+"/pay", `{"amount":100}`, "X-User", "alice", "Idempotency-Key", "k1")
		if err != nil || st != http.StatusCreated {
			t.Fatalf("request %d: %d %v", i, st, err)
		}
		if replayed := hdr.Get(HeaderIdempotentReplayed); (i == 1) != (replayed == "true") {
			t.Errorf("request %d: %s = %q", i, HeaderIdempotentReplayed, replayed)
		}
		bodies = append(bodies, body)
	}
	if c := up.Calls.Load(); c != 1 {
		t.Fatalf("the same idempotency key reached the upstream %d times, want 1", c)
	}
	if bodies[0] != bodies[1] {
		t.Errorf("the replay answered %q, the first answer was %q", bodies[1], bodies[0])
	}
}

// TestReplayMaxLimits: a size that does not fit in an int64 is an error,
// not a wrapped number, and replay_max above MaxReplayMax is refused in
// JSON as in the Caddyfile (where the line is named, see
// TestLockCaddyfileErrors).
func TestReplayMaxLimits(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		in   string
		want int64 // 0: an error
	}{
		{"1MiB", 1 << 20},
		{"256MiB", MaxReplayMax},
		{"64kb", 64000},
		{"9223372036854775807", 1<<63 - 1},
		{"9223372036854775807b", 1<<63 - 1},
		{"8589934591GiB", 8589934591 << 30},
		{"8589934592GiB", 0},  // 2^63
		{"17179869185GiB", 0}, // wrapped to 1 GiB before
		{"9223372036854776KB", 0},
		{"9223372036854775808", 0},
	} {
		got, err := parseSize(c.in)
		if c.want == 0 {
			if err == nil {
				t.Errorf("parseSize(%q) = %d, want an error", c.in, got)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("parseSize(%q) = %d, %v, want %d", c.in, got, err, c.want)
		}
	}
	for _, c := range []struct {
		max int64
		ok  bool
	}{{1, true}, {MaxReplayMax, true}, {MaxReplayMax + 1, false}, {1<<63 - 1, false}, {-1, false}} {
		h := new(RedisLock)
		if err := json.Unmarshal([]byte(fmt.Sprintf(`{"replay":"1m","replay_max":%d}`, c.max)), h); err != nil {
			t.Fatal(err)
		}
		err := h.Validate()
		if c.ok != (err == nil) || err != nil && !strings.Contains(err.Error(), "redis_lock: replay_max: ") {
			t.Errorf("JSON replay_max %d: %v, want ok=%v (an error naming redis_lock: replay_max:)", c.max, err, c.ok)
		}
	}
	h := new(RedisLock)
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\treplay 1m\n\treplay_max 256MiB\n}")); err != nil || h.ReplayMax != MaxReplayMax {
		t.Fatalf("replay_max 256MiB: %v (replay_max %d)", err, h.ReplayMax)
	}
}

// TestReplayLargeMaxForwardsBody: with the largest replay_max the request
// body is fingerprinted and still reaches the upstream whole (a replay_max
// near the int64 limit used to hand it an empty body), and a duplicate is
// replayed.
func TestReplayLargeMaxForwardsBody(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	var calls atomic.Int64
	var got atomic.Value
	echo := func(w http.ResponseWriter, req *http.Request) error {
		calls.Add(1)
		b, err := io.ReadAll(req.Body)
		if err != nil {
			return err
		}
		got.Store(string(b))
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "got %d bytes", len(b))
		return nil
	}
	h := provisionLock(t, testkit.LockConfig(r.Addr, fmt.Sprintf(`%s,"replay_max":%d`, replayCfg, MaxReplayMax)))
	srv := handlerServer(t, h, echo)
	body := strings.Repeat("order-line;", 1000)
	for i := 0; i < 2; i++ {
		st, hdr, resp, err := testkit.Post(srv.URL+"/orders", body, "X-User", "u", "Idempotency-Key", "big")
		want := fmt.Sprintf("got %d bytes", len(body))
		if err != nil || st != 201 || resp != want {
			t.Fatalf("request %d: %d %q %v, want 201 %q", i, st, resp, err, want)
		}
		if replayed := hdr.Get(HeaderIdempotentReplayed) == "true"; replayed != (i == 1) {
			t.Errorf("request %d: replayed %v", i, replayed)
		}
	}
	if s, _ := got.Load().(string); s != body || calls.Load() != 1 {
		t.Fatalf("upstream got %d bytes in %d calls, want the %d-byte body once", len(s), calls.Load(), len(body))
	}
}

// outerHeader is a handler before the lock that sets a response header of
// its own for each request (a request id, CORS).
type outerHeader struct {
	mw caddyhttp.MiddlewareHandler
	n  *atomic.Int64
}

func (o outerHeader) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	w.Header().Set("X-Request-Id", fmt.Sprint("req-", o.n.Add(1)))
	return o.mw.ServeHTTP(w, r, next)
}

// serverHeader sets Server before the lock, as Caddy's server does.
type serverHeader struct{ mw caddyhttp.MiddlewareHandler }

func (s serverHeader) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	w.Header().Set("Server", "Caddy")
	return s.mw.ServeHTTP(w, r, next)
}

// TestReplayAnswersAsTheRouteWrote: a replayed answer is the route's, whichever
// way the route wrote it, and leaves alone what handlers before the lock
// set for the duplicate. Before: a body written with io.Copy (ReadFrom, as
// file_server does) was stored empty or not at all; a request id set
// before the lock was replaced by the first request's; a replayed HEAD
// said Content-Length: 0.
func TestReplayAnswersAsTheRouteWrote(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	const receipt = "the receipt of order #1"
	for name, write := range map[string]func(w http.ResponseWriter){
		"readfrom after WriteHeader": func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.Copy(w, struct{ io.Reader }{strings.NewReader(receipt)}) // no WriteTo: io.Copy uses ReadFrom
		},
		"readfrom alone": func(w http.ResponseWriter) {
			_, _ = io.Copy(w, struct{ io.Reader }{strings.NewReader(receipt)})
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var calls atomic.Int64
			h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"prefix":"rf:`+strings.ReplaceAll(name, " ", "-")+`:"`))
			srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
				calls.Add(1)
				write(w)
				return nil
			})
			for i := 0; i < 2; i++ {
				_, hdr, body, err := testkit.Post(srv.URL+"/pay", "x", "X-User", "u", "Idempotency-Key", "k")
				if err != nil || body != receipt || (hdr.Get(HeaderIdempotentReplayed) == "true") != (i == 1) {
					t.Fatalf("request %d: %q %v replayed=%q, want the receipt", i, body, err, hdr.Get(HeaderIdempotentReplayed))
				}
			}
			if c := calls.Load(); c != 1 {
				t.Fatalf("%d upstream calls, want 1", c)
			}
		})
	}
	t.Run("headers set before the lock", func(t *testing.T) {
		t.Parallel()
		h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"prefix":"outer:"`))
		srv := handlerServer(t, outerHeader{h, new(atomic.Int64)}, func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Set("X-Order", "1")
			_, _ = io.WriteString(w, receipt)
			return nil
		})
		var ids []string
		for i := 0; i < 2; i++ {
			_, hdr, body, _ := testkit.Post(srv.URL+"/pay", "x", "X-User", "u", "Idempotency-Key", "k")
			if body != receipt || hdr.Get("X-Order") != "1" {
				t.Fatalf("request %d: %q X-Order %q, want the route's answer", i, body, hdr.Get("X-Order"))
			}
			ids = append(ids, hdr.Get("X-Request-Id"))
		}
		if ids[0] != "req-1" || ids[1] != "req-2" {
			t.Fatalf("request ids %v, want each request's own (req-1, req-2)", ids)
		}
	})
	t.Run("headers the route removed", func(t *testing.T) {
		t.Parallel()
		// A header set before the lock (Caddy sets Server) that the route
		// removes is not in the replay either: before, a replayed answer
		// carried the Server header the original did not.
		h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"prefix":"removed:"`))
		srv := handlerServer(t, serverHeader{h}, func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Del("Server")
			_, _ = io.WriteString(w, receipt)
			return nil
		})
		for i := 0; i < 2; i++ {
			_, hdr, body, _ := testkit.Post(srv.URL+"/pay", "x", "X-User", "u", "Idempotency-Key", "k")
			if body != receipt || hdr.Get("Server") != "" || (hdr.Get(HeaderIdempotentReplayed) == "true") != (i == 1) {
				t.Fatalf("request %d: %q Server %q replayed %q, want the route's answer without Server", i, body, hdr.Get("Server"), hdr.Get(HeaderIdempotentReplayed))
			}
		}
	})
	t.Run("flush before the first write", func(t *testing.T) {
		t.Parallel()
		h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"prefix":"flushfirst:"`))
		srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Set("X-Early", "1")
			_ = http.NewResponseController(w).Flush() // sends the header
			w.Header().Set("X-Late", "never-sent")
			_, _ = io.WriteString(w, receipt)
			return nil
		})
		for i := 0; i < 2; i++ {
			_, hdr, body, _ := testkit.Post(srv.URL+"/pay", "x", "X-User", "u", "Idempotency-Key", "k")
			if body != receipt || hdr.Get("X-Early") != "1" || hdr.Get("X-Late") != "" {
				t.Fatalf("request %d: %q X-Early %q X-Late %q, want what the first client got", i, body, hdr.Get("X-Early"), hdr.Get("X-Late"))
			}
		}
	})
	t.Run("HEAD", func(t *testing.T) {
		t.Parallel()
		h := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s","prefix":"head:"`))
		srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Set("Content-Length", "1234")
			w.WriteHeader(http.StatusOK)
			return nil
		})
		for i := 0; i < 2; i++ {
			req, _ := http.NewRequest(http.MethodHead, srv.URL+"/file", nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.ContentLength != 1234 || (resp.Header.Get(HeaderIdempotentReplayed) == "true") != (i == 1) {
				t.Fatalf("HEAD %d: Content-Length %d replayed=%q, want 1234", i, resp.ContentLength, resp.Header.Get(HeaderIdempotentReplayed))
			}
		}
	})
	t.Run("replay under 1ms", func(t *testing.T) {
		t.Parallel()
		h := new(RedisLock)
		if err := json.Unmarshal([]byte(testkit.LockConfig(r.Addr, `"replay":"500us"`)), h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "replay") {
			t.Fatalf("replay 500us: %v, want an error naming replay", err)
		}
	})
}

// TestReplayAnswersOfAnEarlierVersion: an answer stored before Head and
// VaryBy were recorded (no "r" in its head) is read as that version meant
// it: its Vary names come from its header, and one that looks like a
// HEAD's (no body, a Content-Length above 0) answers a HEAD but no GET.
func TestReplayAnswersOfAnEarlierVersion(t *testing.T) {
	t.Parallel()
	id := identity{fp: "fp"}
	get := httptest.NewRequest("GET", "/doc", nil)
	head := httptest.NewRequest("HEAD", "/doc", nil)
	old, err := decodeAnswer(replayFormat + "\n" + `{"f":"fp","s":200,"h":{"Content-Length":["9"]}}` + "\n")
	if err != nil {
		t.Fatal(err)
	}
	if why := old.servable(id, get, false); why == "" {
		t.Error("an earlier version's HEAD answer (no body, Content-Length 9) was servable to a GET")
	}
	if why := old.servable(id, head, false); why != "" {
		t.Errorf("an earlier version's HEAD answer to a HEAD: %s", why)
	}
	withBody, _ := decodeAnswer(replayFormat + "\n" + `{"f":"fp","s":200,"h":{"Content-Length":["9"]}}` + "\nfull body")
	if why := withBody.servable(id, get, false); why != "" {
		t.Errorf("an earlier version's GET answer to a GET: %s", why)
	}
	de := httptest.NewRequest("GET", "/doc", nil)
	de.Header.Set("Accept-Language", "de")
	vary, _ := decodeAnswer(replayFormat + "\n" + `{"f":"fp","s":200,"h":{"Vary":["Accept-Language"]},"v":"` + varyHash([]string{"Accept-Language"}, de) + `"}` + "\nbody")
	if why := vary.servable(id, de, false); why != "" {
		t.Errorf("an earlier version's Vary answer to the same Accept-Language: %s", why)
	}
	if why := vary.servable(id, get, false); why == "" {
		t.Error("an earlier version's Vary answer was servable to another Accept-Language")
	}
}

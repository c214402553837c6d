package redislock

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestReplayDetachedRunIsBounded: once its client is gone, a replay route
// runs at most one ttl longer (the lease's auto-extension keeps it) and
// then is cancelled; its answer is not stored and the lock is released.
// The cancelled run may have reached its upstream, so the key is in doubt:
// the client's retry gets 409 and never runs the route, while a GET (safe:
// coalescing) takes the free lock and runs it. With max_hold, the run ends
// at max_hold from the grant.
func TestReplayDetachedRunIsBounded(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, tc := range []struct{ name, cfg string }{
		{"ttl", `,"ttl":"2s"`},
		{"max_hold", `,"ttl":"30s","max_hold":"900ms","on_lost":"continue"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var calls atomic.Int64
			ended := make(chan error, 1)
			started := make(chan struct{}, 1)
			h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+tc.cfg+`,"timeout":"5s","prefix":"bound:`+tc.name+`:"`))
			srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
				if calls.Add(1) == 1 {
					started <- struct{}{}
					<-req.Context().Done() // a route that never finishes by itself
					ended <- context.Cause(req.Context())
					return req.Context().Err()
				}
				_, _ = io.WriteString(w, "second")
				return nil
			})
			leave := startImpatient(t, srv.URL+"/p", started)
			leave()
			select {
			case cause := <-ended:
				if cause != errDetachedRunOver {
					t.Fatalf("the detached run ended with %v, want errDetachedRunOver", cause)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("the detached run was never cancelled")
			}
			st, hdr, _, err := testkit.Post(srv.URL+"/p", "x", "X-User", "u", "Idempotency-Key", "k")
			if err != nil || st != http.StatusConflict || hdr.Get("Retry-After") == "" || calls.Load() != 1 {
				t.Fatalf("the retry: %d Retry-After=%q %v, route runs %d; want 409 with Retry-After and 1 run", st, hdr.Get("Retry-After"), err, calls.Load())
			}
			st, _, body, err := testkit.SendBody("GET", srv.URL+"/p", "", "X-User", "u", "Idempotency-Key", "k")
			if err != nil || st != 200 || body != "second" {
				t.Fatalf("a GET of the key: %d %q %v; want it to run the route (the lock is free)", st, body, err)
			}
		})
	}
}

// startImpatient posts the idempotent request (user u, key k) to url and
// returns once its route started (started receives); calling the returned
// function makes the client go away.
func startImpatient(t *testing.T, url string, started <-chan struct{}) (leave func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader("x"))
	req.Header.Set("X-User", "u")
	req.Header.Set("Idempotency-Key", "k")
	answered := make(chan string, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			answered <- err.Error()
			return
		}
		resp.Body.Close()
		answered <- resp.Status
	}()
	select {
	case <-started:
	case a := <-answered:
		cancel()
		t.Fatalf("the request was answered %s before its route ran", a)
	case <-time.After(15 * time.Second):
		cancel()
		t.Fatal("the request's route never ran")
	}
	return cancel
}

// answerUpstream answers each request as its query says: ?status=,
// ?vary=, ?cc= (Cache-Control), and honours Range with a 206 and
// If-Modified-Since with a 304, like a file server. It counts calls, and
// says in the body who asked (the Authorization header).
type answerUpstream struct{ calls atomic.Int64 }

func (u *answerUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	n := u.calls.Add(1)
	q := r.URL.Query()
	if v := q.Get("vary"); v != "" {
		w.Header().Set("Vary", v)
	}
	if v := q.Get("cc"); v != "" {
		w.Header().Set("Cache-Control", v)
	}
	if q.Get("cookie") != "" {
		w.Header().Set("Set-Cookie", "session="+r.Header.Get("Authorization"))
	}
	body := fmt.Sprintf("answer #%d for %q lang %q", n, r.Header.Get("Authorization"), r.Header.Get("Accept-Language"))
	switch {
	case r.Header.Get("Range") != "":
		w.Header().Set("Content-Range", "bytes 0-3/1000")
		w.WriteHeader(http.StatusPartialContent)
		_, _ = io.WriteString(w, body[:4])
		return nil
	case r.Header.Get("If-Modified-Since") != "":
		w.WriteHeader(http.StatusNotModified)
		return nil
	}
	status := 200
	fmt.Sscan(q.Get("status"), &status)
	w.WriteHeader(status)
	_, _ = io.WriteString(w, body)
	return nil
}

// send makes one request without a body; hdr are name, value pairs.
func send(method, url string, hdr ...string) (int, http.Header, string, error) {
	return testkit.SendBody(method, url, "", hdr...)
}

// TestReplayServesOnlyWhatItCanAnswer: request
// coalescing (`key {http.request.uri}`, replay) is not poisoned by headers
// the fingerprint ignores. A range request's 206 and a conditional
// request's 304 are never stored (a plain GET then runs the route and
// gets the whole answer); a GET's 400 or 409 is not stored; `Vary: *` is
// not stored; `Vary: Accept-Language` joins the fingerprint, so another
// language runs the route itself; a conditional request never gets a
// stored answer. Before the fix a plain GET got the 206 with its
// Content-Range, an empty 304, or another client's 400.
func TestReplayServesOnlyWhatItCanAnswer(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := new(answerUpstream)
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s"`))
	srv := handlerServer(t, h, up.ServeHTTP)

	type step struct {
		name, path string
		hdr        []string
		status     int
		replayed   bool
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"range", []step{
			{"range request", "/r", []string{"Range", "bytes=0-3"}, 206, false},
			{"plain GET after it", "/r", nil, 200, false},
			{"plain GET replayed", "/r", nil, 200, true},
			{"range request with a stored answer", "/r", []string{"Range", "bytes=0-3"}, 206, false},
		}},
		{"conditional", []step{
			{"If-Modified-Since", "/c", []string{"If-Modified-Since", "Mon, 01 Dec 2025 00:00:00 GMT"}, 304, false},
			{"unconditional after it", "/c", nil, 200, false},
			{"If-None-Match with a stored answer", "/c", []string{"If-None-Match", `"x"`}, 200, false},
		}},
		{"client error", []step{
			{"400", "/e?status=400", nil, 400, false},
			{"400 again", "/e?status=400", nil, 400, false},
			{"409", "/e?status=409", nil, 409, false},
			{"409 again", "/e?status=409", nil, 409, false},
			{"404 is stored", "/e?status=404", nil, 404, false},
			{"404 replayed", "/e?status=404", nil, 404, true},
		}},
		{"vary", []step{
			{"Vary: *", "/v?vary=*", nil, 200, false},
			{"Vary: * again", "/v?vary=*", nil, 200, false},
			{"Vary: Accept-Language, en", "/l?vary=Accept-Language", []string{"Accept-Language", "en"}, 200, false},
			{"en again", "/l?vary=Accept-Language", []string{"Accept-Language", "en"}, 200, true},
			{"de", "/l?vary=Accept-Language", []string{"Accept-Language", "de"}, 200, false},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, s := range tc.steps {
				before := up.calls.Load()
				st, hdr, body, err := send("GET", srv.URL+s.path, s.hdr...)
				replayed := hdr.Get(HeaderIdempotentReplayed) == "true"
				if err != nil || st != s.status || replayed != s.replayed || (up.calls.Load() == before) != s.replayed {
					t.Fatalf("%s: %d %q replayed=%v (upstream calls %d → %d) %v; want %d, replayed=%v",
						s.name, st, body, replayed, before, up.calls.Load(), err, s.status, s.replayed)
				}
				if !replayed && s.status == 200 && hdr.Get("Content-Range") != "" {
					t.Fatalf("%s: a 200 with Content-Range %q", s.name, hdr.Get("Content-Range"))
				}
			}
		})
	}
	t.Run("POST statuses", func(t *testing.T) {
		// Transient answers are stored for no method; a POST's 400 is (the
		// same request would get it again).
		for _, tc := range []struct {
			status int
			stored bool
		}{{409, false}, {429, false}, {425, false}, {408, false}, {400, true}, {201, true}} {
			path := fmt.Sprintf("/post?status=%d", tc.status)
			send("POST", srv.URL+path)
			_, hdr, _, _ := send("POST", srv.URL+path)
			if got := hdr.Get(HeaderIdempotentReplayed) == "true"; got != tc.stored {
				t.Errorf("POST answered %d: replayed=%v, want %v", tc.status, got, tc.stored)
			}
		}
	})
}

// TestReplayNeverAnotherClientsAnswer: the fingerprint
// covers the credentials. Alice's answer to a GET (private, with her
// cookie) is never replayed to Bob: his GET runs the route itself, and
// his POST under a key Alice used is 422. A private answer goes only to
// the same Cookie header when no credential cookie is named, and with
// credential_cookies only the named cookie counts. `fingerprint off`
// still keeps private answers to their owner. Before the fix Bob got
// Alice's body and cookie, marked replayed.
func TestReplayNeverAnotherClientsAnswer(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := new(answerUpstream)
	coalesce := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s","prefix":"co:"`))
	sc := handlerServer(t, coalesce, up.ServeHTTP)

	const alice, bob = "Bearer alice", "Bearer bob"
	_, _, body, _ := send("GET", sc.URL+"/balance?cc=private&cookie=1", "Authorization", alice)
	if !strings.Contains(body, alice) {
		t.Fatalf("alice's GET: %q", body)
	}
	st, hdr, body, _ := send("GET", sc.URL+"/balance?cc=private&cookie=1", "Authorization", bob)
	if st != 200 || hdr.Get(HeaderIdempotentReplayed) != "" || !strings.Contains(body, bob) || strings.Contains(hdr.Get("Set-Cookie"), "alice") {
		t.Fatalf("bob's GET: %d %q replayed=%q Set-Cookie %q; want his own answer", st, body, hdr.Get(HeaderIdempotentReplayed), hdr.Get("Set-Cookie"))
	}
	_, hdr, body, _ = send("GET", sc.URL+"/balance?cc=private&cookie=1", "Authorization", alice)
	if hdr.Get(HeaderIdempotentReplayed) != "true" || !strings.Contains(body, alice) {
		t.Fatalf("alice again: %q replayed=%q; want her stored answer", body, hdr.Get(HeaderIdempotentReplayed))
	}
	// The same credentials with another Cookie header: a private answer is
	// not theirs (no credential cookie named).
	_, hdr, _, _ = send("GET", sc.URL+"/balance?cc=private&cookie=1", "Authorization", alice, "Cookie", "session=other")
	if hdr.Get(HeaderIdempotentReplayed) != "" {
		t.Fatal("a private answer was replayed to another Cookie header")
	}
	// Unsafe method, other credentials: 422, and the upstream is not called.
	before := up.calls.Load()
	send("POST", sc.URL+"/order", "Authorization", alice)
	if st, _, _, _ := send("POST", sc.URL+"/order", "Authorization", bob); st != 422 || up.calls.Load() != before+1 {
		t.Fatalf("bob's POST under alice's key: %d (upstream calls %d → %d), want 422 and no call", st, before, up.calls.Load())
	}

	// credential_cookies: only the named cookie counts, so an analytics
	// cookie that changed does not break the retry, and another session
	// does not get the answer.
	cc := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s","prefix":"cc:","credential_cookies":["session"]`))
	scc := handlerServer(t, cc, up.ServeHTTP)
	send("GET", scc.URL+"/me?cc=no-store", "Cookie", "session=s1; _ga=1")
	if _, hdr, _, _ := send("GET", scc.URL+"/me?cc=no-store", "Cookie", "session=s1; _ga=2"); hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatal("credential_cookies session: the same session with another analytics cookie was not replayed")
	}
	if _, hdr, _, _ := send("GET", scc.URL+"/me?cc=no-store", "Cookie", "session=s2; _ga=1"); hdr.Get(HeaderIdempotentReplayed) != "" {
		t.Fatal("credential_cookies session: another session got the stored answer")
	}

	// fingerprint off: any request with the key gets a public answer, but
	// a private one only goes to its owner.
	off := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s","prefix":"off:","fingerprint":["off"]`))
	so := handlerServer(t, off, up.ServeHTTP)
	send("GET", so.URL+"/pub", "Authorization", alice)
	if _, hdr, _, _ := send("GET", so.URL+"/pub", "Authorization", bob); hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatal("fingerprint off: a public answer was not replayed")
	}
	send("GET", so.URL+"/priv?cc=private", "Authorization", alice)
	if _, hdr, body, _ := send("GET", so.URL+"/priv?cc=private", "Authorization", bob); hdr.Get(HeaderIdempotentReplayed) != "" || strings.Contains(body, alice) {
		t.Fatalf("fingerprint off: alice's private answer went to bob: %q", body)
	}
}

// headerBefore is a handler before the lock that sets a response header at
// once, as Caddy's `header` directive (ordered before redis_lock) does.
type headerBefore struct {
	mw          caddyhttp.MiddlewareHandler
	name, value string
}

func (hb headerBefore) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	w.Header().Set(hb.name, hb.value)
	return hb.mw.ServeHTTP(w, r, next)
}

// TestReplayMarksSetBeforeTheLock: Cache-Control private, Vary and Vary: *
// set by a handler before the lock mark the answer the client gets, so
// they decide what the stored answer may serve as if the route had set
// them (never another client's private answer; Vary joins the
// fingerprint; Vary: * is never stored).
func TestReplayMarksSetBeforeTheLock(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	up := new(answerUpstream)
	site := func(prefix, name, value string) string {
		h := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s","prefix":"`+prefix+`"`))
		return handlerServer(t, headerBefore{h, name, value}, up.ServeHTTP).URL
	}

	private := site("before-cc:", "Cache-Control", "private, no-store")
	send("GET", private+"/account", "Cookie", "sess=alice")
	if _, hdr, body, _ := send("GET", private+"/account", "Cookie", "sess=bob"); hdr.Get(HeaderIdempotentReplayed) != "" {
		t.Fatalf("Cache-Control private set before the lock: another Cookie header got the stored answer %q", body)
	}
	if _, hdr, _, _ := send("GET", private+"/account", "Cookie", "sess=alice"); hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatal("Cache-Control private set before the lock: the same Cookie header was not replayed")
	}

	vary := site("before-vary:", "Vary", "Accept-Language")
	send("GET", vary+"/page", "Accept-Language", "de")
	if _, hdr, body, _ := send("GET", vary+"/page", "Accept-Language", "fr"); hdr.Get(HeaderIdempotentReplayed) != "" {
		t.Fatalf("Vary set before the lock: another Accept-Language got the stored answer %q", body)
	}
	if _, hdr, _, _ := send("GET", vary+"/page", "Accept-Language", "de"); hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatal("Vary set before the lock: the same Accept-Language was not replayed")
	}

	star := site("before-star:", "Vary", "*")
	send("GET", star+"/any")
	if _, hdr, _, _ := send("GET", star+"/any"); hdr.Get(HeaderIdempotentReplayed) != "" {
		t.Fatal("Vary: * set before the lock: the answer was stored and replayed")
	}
}

// TestReplayNotPassedByAHandOff: a handler without replay on the same key
// (and lease options) never hands its lease to a replay waiter: the
// waiter asks Redis, and the client's retry gets the stored answer (a
// retried POST never reaches the upstream twice).
func TestReplayNotPassedByAHandOff(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	keys := `"keys":["{http.request.header.Idem}"],"wait":"20s","prefix":"mixed:"`
	hr := provisionLock(t, testkit.LockConfig(r.Addr, keys+`,"replay":"30s"`))
	hn := provisionLock(t, testkit.LockConfig(r.Addr, keys))
	var calls atomic.Int64
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	up := func(w http.ResponseWriter, req *http.Request) error {
		n := calls.Add(1)
		if n == 1 {
			started <- struct{}{}
			<-release
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, fmt.Sprint("order ", n))
		return nil
	}
	sr, sn := handlerServer(t, hr, up), handlerServer(t, hn, up)
	first := make(chan string, 1)
	go func() { _, _, body, _ := testkit.Post(sr.URL+"/pay", "x", "Idem", "k1"); first <- body }()
	<-started
	other := make(chan int, 1)
	go func() { st, _, _, _ := send("GET", sn.URL+"/status", "Idem", "k1"); other <- st }()
	waitQueued(t, hn, shared.StoredKey(hn.Prefix, "k1"))
	retry := make(chan [2]string, 1)
	go func() {
		_, hdr, body, _ := testkit.Post(sr.URL+"/pay", "x", "Idem", "k1")
		retry <- [2]string{body, hdr.Get(HeaderIdempotentReplayed)}
	}()
	waitQueued(t, hr, shared.StoredKey(hr.Prefix, "k1")) // the retry, in its handler's queue
	close(release)
	if body := <-first; body != "order 1" {
		t.Fatalf("first POST: %q", body)
	}
	<-other
	got := <-retry
	if got[0] != "order 1" || got[1] != "true" || calls.Load() != 2 {
		t.Fatalf("the retry got %q (replayed %q), upstream calls %d; want the stored order 1 and 2 calls (the POST and the other handler's GET)", got[0], got[1], calls.Load())
	}
}

// TestReplayCutOffAtItsBound: a route whose client went away and that was
// cancelled at its bound, but still writes an answer and returns without
// an error, stores nothing, and its release is unclean: lock_delay
// applies (it is cancelled and nothing is stored; its upstream may still
// be writing).
func TestReplayCutOffAtItsBound(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, panics := range []bool{false, true} {
		// A route that panics on its way out (reverse_proxy aborts a copy
		// its cancelled context cut short) is cut off too.
		prefix := fmt.Sprintf("cut-%v:", panics)
		h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"ttl":"1s","lock_delay":"20s","timeout":"5s","prefix":"`+prefix+`"`))
		started := make(chan struct{}, 1)
		returned := make(chan error, 1)
		srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
			started <- struct{}{}
			<-req.Context().Done() // cancelled at the bound
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "late answer")
			returned <- context.Cause(req.Context())
			if panics {
				panic(http.ErrAbortHandler)
			}
			return nil
		})
		leave := startImpatient(t, srv.URL+"/p", started)
		leave()
		select {
		case cause := <-returned:
			if cause != errDetachedRunOver {
				t.Fatalf("panics %v: the route was cancelled with %v, want errDetachedRunOver", panics, cause)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("panics %v: the detached run was never cancelled", panics)
		}
		key := shared.StoredKey(h.Prefix, "u:k")
		c := r.Client()
		if !waitFor(10*time.Second, func() bool { return c.ZCard(context.Background(), lock.DelayKey(key)).Val() == 1 }) {
			t.Fatalf("panics %v: the release of a route cut off at its bound was clean: no lock_delay entry", panics)
		}
		if v := c.Get(context.Background(), lock.ReplayKey(key)).Val(); v != "" && !strings.HasPrefix(v, "run1\n") {
			t.Fatalf("panics %v: the answer of a route cut off at its bound was stored", panics)
		}
		if c.PTTL(context.Background(), lock.DelayKey(key)).Val() <= 0 {
			t.Fatalf("panics %v: the lock_delay entry has no expiry", panics)
		}
	}
}

// TestReplayHeadAnswerNotForGet: with a fingerprint without the method, a
// HEAD's answer (no body) is not replayed to a GET (a stored answer is
// only for requests it can answer); to a HEAD it is.
func TestReplayHeadAnswerNotForGet(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["{http.request.uri}"],"replay":"30s","wait":"20s","prefix":"head:","fingerprint":["{http.request.uri}"]`))
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		w.WriteHeader(http.StatusOK)
		if req.Method != http.MethodHead {
			_, _ = io.WriteString(w, "full body")
		}
		return nil
	})
	send("HEAD", srv.URL+"/doc")
	if _, hdr, _, _ := send("HEAD", srv.URL+"/doc"); hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatal("a HEAD's stored answer was not replayed to a HEAD")
	}
	if st, hdr, body, _ := send("GET", srv.URL+"/doc"); body != "full body" || hdr.Get(HeaderIdempotentReplayed) != "" {
		t.Fatalf("GET after HEAD: %d %q replayed=%q; want the route's own answer", st, body, hdr.Get(HeaderIdempotentReplayed))
	}
}

package redislock

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
)

// Never twice: under replay, an unsafe method's run happens at most once
// per key within the replay window, whatever happens to its holder. A
// holder that outlives its lease (auto_extend off stands for a paused
// process: nothing extends the lease while the route runs) is the case.

// neverTwiceCfg: a 500ms lease nobody extends, on_lost continue (the route
// is not cancelled when the lease runs out, as a paused holder's is not).
const neverTwiceCfg = replayCfg + `,"ttl":"500ms","auto_extend":false,"on_lost":"continue","timeout":"5s"`

// TestNeverTwiceHolderPastItsLease: a duplicate that comes after the
// holder's lease ran out, while the holder still runs, gets 409 with
// Retry-After and never reaches the upstream; the holder's answer, which
// starts after its own clock says the lease ended, is stored as the run's
// own and only then sent; later duplicates are replayed it.
func TestNeverTwiceHolderPastItsLease(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, neverTwiceCfg+`,"prefix":"nt:past:"`))
	up := new(testkit.OrderUpstream)
	srv := handlerServer(t, h, up.ServeHTTP)
	first := make(chan [2]string, 1)
	go func() {
		st, _, body, err := testkit.Post(srv.URL+"/o?sleep=1500ms", "x", "X-User", "u", "Idempotency-Key", "k")
		if err != nil {
			body = err.Error()
		}
		first <- [2]string{http.StatusText(st), body}
	}()
	if !waitFor(5*time.Second, func() bool { return up.Calls.Load() == 1 }) {
		t.Fatal("the first request never reached the upstream")
	}
	key := shared.StoredKey(h.Prefix, "u:k")
	if !waitFor(5*time.Second, func() bool { return r.Client().ZCard(context.Background(), key).Val() == 0 }) {
		t.Fatal("the holder's lease never ran out")
	}
	st, hdr, body, err := testkit.Post(srv.URL+"/o?sleep=1500ms", "x", "X-User", "u", "Idempotency-Key", "k")
	if err != nil || st != http.StatusConflict || hdr.Get("Retry-After") == "" || !strings.Contains(body, "outcome is unknown") {
		t.Fatalf("a duplicate while the run is in doubt: %d %q Retry-After=%q %v; want 409 with a reason and Retry-After", st, body, hdr.Get("Retry-After"), err)
	}
	got := <-first
	if got[0] != "Created" || got[1] != "order #1" {
		t.Fatalf("the holder's client got %s %q; want its own answer, order #1", got[0], got[1])
	}
	st, hdr, body, err = testkit.Post(srv.URL+"/o?sleep=1500ms", "x", "X-User", "u", "Idempotency-Key", "k")
	if err != nil || st != http.StatusCreated || body != "order #1" || hdr.Get(HeaderIdempotentReplayed) != "true" {
		t.Fatalf("a duplicate after the run ended: %d %q replayed=%q %v; want order #1 replayed", st, body, hdr.Get(HeaderIdempotentReplayed), err)
	}
	if c := up.Calls.Load(); c != 1 {
		t.Fatalf("the upstream ran %d times, want once", c)
	}
}

// TestNeverTwiceWithheldAnswerNotStorable: an answer that starts after the
// holder's lease ended and cannot be stored (over replay_max) never goes
// out: the holder's client gets 503 with Retry-After, and the key stays in
// doubt (the duplicate gets 409). A 5xx the route writes then goes out and
// clears the key: the next duplicate runs.
func TestNeverTwiceWithheldAnswerNotStorable(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, tc := range []struct {
		name, query string
		holder      int // what the holder's client gets
		next        int // what the duplicate after it gets
		calls       int64
	}{
		{"over replay_max", "size=100", http.StatusServiceUnavailable, http.StatusConflict, 1},
		{"5xx", "status=502", http.StatusBadGateway, http.StatusBadGateway, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := provisionLock(t, testkit.LockConfig(r.Addr, neverTwiceCfg+`,"replay_max":64,"prefix":"nt:w:`+tc.name+`:"`))
			up := new(testkit.OrderUpstream)
			srv := handlerServer(t, h, up.ServeHTTP)
			st, hdr, body, err := testkit.Post(srv.URL+"/o?sleep=900ms&"+tc.query, "x", "X-User", "u", "Idempotency-Key", "k")
			if err != nil || st != tc.holder || (st == 503 && (hdr.Get("Retry-After") == "" || strings.Contains(body, "xxx") || hdr.Get("X-Order") != "")) {
				t.Fatalf("the holder's client: %d %q Retry-After=%q X-Order=%q %v; want %d (a 503 carries none of the withheld answer)",
					st, body, hdr.Get("Retry-After"), hdr.Get("X-Order"), err, tc.holder)
			}
			if st, _, _, _ := testkit.Post(srv.URL+"/o?sleep=900ms&"+tc.query, "x", "X-User", "u", "Idempotency-Key", "k"); st != tc.next || up.Calls.Load() != tc.calls {
				t.Fatalf("the duplicate: %d, upstream calls %d; want %d and %d", st, up.Calls.Load(), tc.next, tc.calls)
			}
		})
	}
}

// TestNeverTwiceOnlyOwnRecordStores: a holder whose run record was cleared
// (an operator's DELETE .../replay) while it ran past its lease, and whose
// key another request then ran, may not store its answer over that run:
// its client gets 503 and the other run's record stays.
func TestNeverTwiceOnlyOwnRecordStores(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, neverTwiceCfg+`,"prefix":"nt:own:"`))
	var calls atomic.Int64
	release := make(chan struct{})
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		if calls.Add(1) == 1 {
			<-release
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("answer"))
		return nil
	})
	first := make(chan int, 1)
	go func() {
		st, _, _, _ := testkit.Post(srv.URL+"/o", "x", "X-User", "u", "Idempotency-Key", "k")
		first <- st
	}()
	key := shared.StoredKey(h.Prefix, "u:k")
	c := r.Client()
	if !waitFor(5*time.Second, func() bool { return calls.Load() == 1 && c.ZCard(context.Background(), key).Val() == 0 }) {
		t.Fatal("the holder never ran past its lease")
	}
	c.Del(context.Background(), lock.ReplayKey(key)) // what DELETE .../replay does
	// Another run of the key takes its own record (its holder still runs).
	second := make(chan int, 1)
	go func() {
		st, _, _, _ := testkit.Post(srv.URL+"/o", "x", "X-User", "u", "Idempotency-Key", "k")
		second <- st
	}()
	if st := <-second; st != http.StatusCreated {
		t.Fatalf("the run after the clear: %d, want 201", st)
	}
	close(release)
	if st := <-first; st != http.StatusServiceUnavailable {
		t.Fatalf("the first holder, whose record was taken over: %d, want 503", st)
	}
}

// TestAdminInDoubt: the lock's GET shows in_doubt for a run record with no
// stored answer and no live lease (never the holder's token), and DELETE
// .../replay clears it: the next request with the key runs the route.
func TestAdminInDoubt(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, replayCfg+`,"timeout":"5s","prefix":"nt:admin:"`))
	var calls atomic.Int64
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		if calls.Add(1) == 1 {
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("half"))
			return io.ErrUnexpectedEOF // the upstream broke off: in doubt
		}
		w.WriteHeader(http.StatusCreated)
		return nil
	})
	testkit.Post(srv.URL+"/o", "x", "X-User", "u", "Idempotency-Key", "k")
	inspect := func() (map[string]any, string) {
		t.Helper()
		w := httptest.NewRecorder()
		if err := h.inspectLock(w, httptest.NewRequest("GET", "/", nil), &shared.AdminEntry{Handler: h}, "u:k"); err != nil {
			t.Fatalf("inspect: %v", err)
		}
		var m map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		return m["servers"].([]any)[0].(map[string]any), w.Body.String()
	}
	var sv map[string]any
	var body string
	if !waitFor(5*time.Second, func() bool { sv, body = inspect(); return sv["in_doubt"] == true }) {
		t.Fatalf("the lock view after a run broken off: %s; want in_doubt true", body)
	}
	if rv, _ := sv["replay"].(map[string]any); rv == nil || rv["format"] != "run1" || rv["status"] != nil {
		t.Errorf("the run record's replay view: %s; want format run1 and no status", body)
	}
	if tok := r.Client().Get(context.Background(), lock.ReplayKey(shared.StoredKey(h.Prefix, "u:k"))).Val(); strings.Contains(body, strings.Split(tok, "\n")[1]) {
		t.Fatalf("the lock view shows the holder's token: %s", body)
	}
	if st, _, _, _ := testkit.Post(srv.URL+"/o", "x", "X-User", "u", "Idempotency-Key", "k"); st != http.StatusConflict {
		t.Fatalf("a duplicate while in doubt: %d, want 409", st)
	}
	w := httptest.NewRecorder()
	if err := h.clearReplay(w, httptest.NewRequest("DELETE", "/", nil), &shared.AdminEntry{Handler: h}, "u:k"); err != nil || !strings.Contains(w.Body.String(), `"cleared": true`) {
		t.Fatalf("DELETE .../replay: %v %s", err, w.Body.String())
	}
	if sv, body := inspect(); sv["in_doubt"] != false {
		t.Errorf("after the clear: %s; want in_doubt false", body)
	}
	if st, _, _, _ := testkit.Post(srv.URL+"/o", "x", "X-User", "u", "Idempotency-Key", "k"); st != http.StatusCreated || calls.Load() != 2 {
		t.Fatalf("the request after the clear: %d, %d runs; want 201 and the route run again", st, calls.Load())
	}
	w = httptest.NewRecorder()
	err := h.clearReplay(w, httptest.NewRequest("DELETE", "/", nil), &shared.AdminEntry{Handler: h}, "never")
	if ae, ok := err.(caddy.APIError); !ok || ae.HTTPStatus != http.StatusNotFound {
		t.Fatalf("DELETE .../replay of a key with nothing: %v, want 404", err)
	}
}

package redisdlm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redisfence"
	"github.com/caddy-dlm/redisdlm/redislock"
)

// e2eStorage is the storage behind the fencing Caddy: it records every
// write that reaches it, per path, in the order they arrive.
type e2eStorage struct {
	mu     sync.Mutex
	writes map[string][]int64
}

func (s *e2eStorage) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	tok, _ := strconv.ParseInt(r.Header.Get(redislock.DefaultFencingHeader), 10, 64)
	s.mu.Lock()
	s.writes[r.URL.Path] = append(s.writes[r.URL.Path], tok)
	s.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (s *e2eStorage) seen(path string) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.writes[path])
}

// e2eApp is the application behind the locking Caddys. For every request it
// writes once to the storage, through the fencing Caddy, with the token the
// lock gave it. A request from client "A" then stays in progress (so A's
// lock stays held) until the test releases it, and writes a second time
// with the same token: the write of a holder that was paused past its
// lease. It sends that write whatever became of the request meanwhile, as
// a paused process would.
type e2eApp struct {
	fence   string        // the fencing Caddy's URL
	release chan struct{} // closed by the test: A's delayed writes go out

	mu      sync.Mutex
	tokens  map[string]int64 // "A /path" → the token the lock gave
	first   map[string]int   // the fence's answer to the first write
	delayed map[string]int   // the fence's answer to A's delayed write
	arrived chan string      // "A /path" once its first write was answered
	done    chan string      // "A /path" once its delayed write was answered
}

func (a *e2eApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	who := r.Header.Get("X-Client") + " " + r.URL.Path
	tok := r.Header.Get(redislock.DefaultFencingHeader)
	n, _ := strconv.ParseInt(tok, 10, 64)
	status := a.write(r.URL.Path, tok)
	a.mu.Lock()
	a.tokens[who], a.first[who] = n, status
	a.mu.Unlock()
	if r.Header.Get("X-Client") != "A" {
		w.WriteHeader(status)
		return
	}
	a.arrived <- who
	select {
	case <-a.release:
	case <-time.After(60 * time.Second): // bounded, in case the test never releases it
	}
	status = a.write(r.URL.Path, tok)
	a.mu.Lock()
	a.delayed[who] = status
	a.mu.Unlock()
	a.done <- who
	w.WriteHeader(status)
}

// write PUTs to the storage through the fencing Caddy, on a context of its
// own, and returns the answer's status (0 for no answer).
func (a *e2eApp) write(path, token string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPut, a.fence+path, strings.NewReader("balance=1"))
	req.Header.Set(redislock.DefaultFencingHeader, token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func (a *e2eApp) token(who string) int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.tokens[who]
}

func (a *e2eApp) get(m map[string]int, who string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return m[who]
}

// TestFenceEndToEndPausedHolder: fencing
// protects the data from a holder whose Caddy was paused past its lease.
// Three Caddy processes, as in docs/fence.md's two tiers: locking Caddys A
// and B (redis_lock, ttl 2s, auto_extend on, one Redis) in front of the
// application, and the fencing Caddy F (redis_fence on a Redis of its own)
// in front of the storage. A's request holds the lock while its upstream
// call is in progress and writes once; A is SIGSTOPped, so it cannot
// extend; its lease runs out, B takes the lock with a higher token and
// writes; A is resumed, finds its lease lost (503 to its client); then the
// application's delayed write with A's token goes out — after B's.
//
// The same run also sends one key through a route of F without
// redis_fence, the control: there the storage does get A's stale write
// after B's, so the scenario really produces the stale write that the
// fence refuses with 409 on the fenced key.
func TestFenceEndToEndPausedHolder(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	lockRedis, fenceRedis := startRedis(t), startRedis(t)

	store := &e2eStorage{writes: map[string][]int64{}}
	storeSrv := httptest.NewServer(store)
	t.Cleanup(storeSrv.Close)
	portF, portA, portB := freePort(t), freePort(t), freePort(t)
	app := &e2eApp{fence: fmt.Sprintf("http://127.0.0.1:%d", portF), release: make(chan struct{}),
		tokens: map[string]int64{}, first: map[string]int{}, delayed: map[string]int{},
		arrived: make(chan string, 4), done: make(chan string, 4)}
	appSrv := httptest.NewServer(app)
	t.Cleanup(appSrv.Close)
	// Released before the servers close (cleanups run last first), so
	// that no handler of a failed run is left waiting for it.
	var once sync.Once
	releaseA := func() { once.Do(func() { close(app.release) }) }
	t.Cleanup(releaseA)

	global := func(dir string) string {
		return fmt.Sprintf("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n\tstorage file_system %s\n\tlog {\n\t\tlevel WARN\n\t}\n}\n", dir)
	}
	startCaddyProcess(t, "F", portF, func(dir string) string {
		return global(dir) + fmt.Sprintf(`http://127.0.0.1:%d {
	handle /fenced/* {
		redis_fence {
			redis %s
		}
		reverse_proxy %s
	}
	handle /plain/* {
		reverse_proxy %s
	}
}
`, portF, fenceRedis.Addr, storeSrv.Listener.Addr(), storeSrv.Listener.Addr())
	})
	locking := func(port int) func(string) string {
		return func(dir string) string {
			return global(dir) + fmt.Sprintf(`http://127.0.0.1:%d {
	redis_lock {
		ttl 2s
		auto_extend on
		wait 20s
		redis %s
	}
	reverse_proxy %s
}
`, port, lockRedis.Addr, appSrv.Listener.Addr())
		}
	}
	a := startCaddyProcess(t, "A", portA, locking(portA))
	b := startCaddyProcess(t, "B", portB, locking(portB))

	paths := []string{"/fenced/7", "/plain/7"}
	fenceRedis.AwaitUptime(3 * time.Second) // the lock's tokens are newer than the fence's Redis
	answersA := map[string]<-chan testkit.FetchResult{}
	for _, p := range paths {
		answersA[p] = goFetchHdr(a.url()+p, "X-Client", "A")
	}
	for range paths {
		select {
		case who := <-app.arrived:
			if got := app.get(app.first, who); got != http.StatusNoContent {
				t.Fatalf("%s: first write answered %d, want 204 from the storage", who, got)
			}
		case <-time.After(60 * time.Second):
			t.Fatal("A's requests never reached the application")
		}
	}

	// A pauses while both its requests hold their locks.
	a.signal(t, syscall.SIGSTOP)
	resumed := false
	defer func() {
		if !resumed {
			a.signal(t, syscall.SIGCONT)
		}
	}()
	// B waits until A's leases run out (2s at most: A cannot extend), takes
	// both locks and writes.
	answersB := map[string]<-chan testkit.FetchResult{}
	for _, p := range paths {
		answersB[p] = goFetchHdr(b.url()+p, "X-Client", "B")
	}
	for _, p := range paths {
		if res := testkit.Await(t, answersB[p], 60*time.Second, "B "+p); res.Status != http.StatusNoContent {
			t.Fatalf("B %s: %d %v, want 204 (B's write stored)", p, res.Status, res.Err)
		}
	}
	for _, p := range paths {
		ta, tb := app.token("A "+p), app.token("B "+p)
		if tb <= ta {
			t.Fatalf("%s: B's token %d is not above A's %d", p, tb, ta)
		}
	}

	// A resumes: its next extension finds the lease lost, and on_lost
	// cancel answers its client 503.
	a.signal(t, syscall.SIGCONT)
	resumed = true
	for _, p := range paths {
		if res := testkit.Await(t, answersA[p], 60*time.Second, "A "+p); res.Status != http.StatusServiceUnavailable {
			t.Errorf("A %s after the pause: %d %v, want 503 (lease lost, on_lost cancel)", p, res.Status, res.Err)
		}
	}

	// The application's delayed write with A's token goes out, after B's.
	releaseA()
	for range paths {
		select {
		case <-app.done:
		case <-time.After(60 * time.Second):
			t.Fatal("A's delayed writes were never answered")
		}
	}
	ta, tb := app.token("A /fenced/7"), app.token("B /fenced/7")
	if got := app.get(app.delayed, "A /fenced/7"); got != http.StatusConflict {
		t.Errorf("A's delayed write through redis_fence: %d, want 409", got)
	}
	if got, want := store.seen("/fenced/7"), []int64{ta, tb}; !slices.Equal(got, want) {
		t.Errorf("the storage saw %v on the fenced key, want A's first write then B's, %v: never A's stale token after B's", got, want)
	}
	// The control: without the fence the stale write lands after B's.
	pa, pb := app.token("A /plain/7"), app.token("B /plain/7")
	if got := app.get(app.delayed, "A /plain/7"); got != http.StatusNoContent {
		t.Errorf("A's delayed write without the fence: %d, want 204 (the control: the storage takes it)", got)
	}
	if got, want := store.seen("/plain/7"), []int64{pa, pb, pa}; !slices.Equal(got, want) {
		t.Errorf("the storage saw %v on the unfenced key, want %v (the stale write after B's)", got, want)
	}
	if rec, err := fenceRedis.Client().Get(context.Background(), shared.StoredKey(redisfence.DefaultFencePrefix, "/fenced/7")).Int64(); err != nil || rec != tb {
		t.Errorf("the fence's record: %d %v, want B's token %d", rec, err, tb)
	}
}

// TestFenceEndToEndRedisRestart: a fencing Caddy process
// whose Redis is killed (SIGKILL) and restarted empty on its port. T2 was
// written and T1 < T2 refused before; after the restart, with the record
// gone, T1 is refused twice and T2 too (a hold across the restart), and
// the storage sees none of them; a token issued after the restart passes.
func TestFenceEndToEndRedisRestart(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	fenceRedis := startRedis(t)
	store := &e2eStorage{writes: map[string][]int64{}}
	storeSrv := httptest.NewServer(store)
	t.Cleanup(storeSrv.Close)
	port := freePort(t)
	f := startCaddyProcess(t, "F", port, func(dir string) string {
		return fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	storage file_system %s
	log {
		level WARN
	}
}
http://127.0.0.1:%d {
	redis_fence {
		redis %s
	}
	reverse_proxy %s
}
`, dir, port, fenceRedis.Addr, storeSrv.Listener.Addr())
	})
	writer := &e2eApp{fence: f.url()}
	put := func(token int64) int { return writer.write("/accounts/7", strconv.FormatInt(token, 10)) }

	fenceRedis.AwaitUptime(3 * time.Second)
	t1 := fenceRedis.Micros()
	t2 := t1 + 1000
	if got := put(t2); got != http.StatusNoContent {
		t.Fatalf("T2 before the restart: %d, want 204", got)
	}
	if got := put(t1); got != http.StatusConflict {
		t.Fatalf("T1 < T2 before the restart: %d, want 409", got)
	}
	fenceRedis.Restart()
	for _, tc := range []struct {
		name  string
		token int64
	}{{"T1 after the restart", t1}, {"T1 again", t1}, {"T2, a hold across the restart", t2}} {
		if got := put(tc.token); got != http.StatusConflict {
			t.Errorf("%s: %d, want 409 (the token is older than the fence's Redis process)", tc.name, got)
		}
	}
	fenceRedis.AwaitUptime(3 * time.Second)
	t3 := fenceRedis.Micros()
	if got := put(t3); got != http.StatusNoContent {
		t.Errorf("a token issued after the restart: %d, want 204", got)
	}
	if got, want := store.seen("/accounts/7"), []int64{t2, t3}; !slices.Equal(got, want) {
		t.Errorf("the storage saw %v, want T2 before the restart and the new token after it, %v", got, want)
	}
}

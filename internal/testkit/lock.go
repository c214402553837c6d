package testkit

// What the lock's tests share, in redislock and in the root (whole Caddy,
// the lock with other modules): requests sent in the background, upstreams
// that hold the lock or watch its exclusivity, a redis_lock config, the
// pooled client behind a handler.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
)

// FetchClient is the client of Fetch: keep-alive for many concurrent
// closed-loop clients, and a bound on every request.
var FetchClient = &http.Client{
	Transport: &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 64},
	Timeout:   45 * time.Second,
}

// Fetch sends one GET and returns its status and headers; it never
// touches testing.T, so it is safe in goroutines that may outlive a
// failing test's main body.
func Fetch(ctx context.Context, url string) (int, http.Header, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := FetchClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header, nil
}

// FetchResult is the outcome of one request sent in the background.
type FetchResult struct {
	Status int
	Hdr    http.Header
	Err    error
	Took   time.Duration
}

// GoFetch sends a GET in the background; the channel gets exactly one result.
func GoFetch(ctx context.Context, url string) <-chan FetchResult {
	ch := make(chan FetchResult, 1)
	go func() {
		start := time.Now()
		s, h, err := Fetch(ctx, url)
		ch <- FetchResult{Status: s, Hdr: h, Err: err, Took: time.Since(start)}
	}()
	return ch
}

// Await waits for a background request, at most d.
func Await(t testing.TB, ch <-chan FetchResult, d time.Duration, what string) FetchResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(d):
		t.Errorf("%s: no answer within %s", what, d)
		return FetchResult{Err: fmt.Errorf("no answer within %s", d)}
	}
}

// LockConfig builds a redis_lock JSON config on one Redis server; extra
// is more of its fields, or "".
func LockConfig(addr, extra string) string {
	if extra == "" {
		return fmt.Sprintf(`{"redis":[%q]}`, addr)
	}
	return fmt.Sprintf(`{"redis":[%q],%s}`, addr, extra)
}

// HoldUpstream blocks requests with ?who=holder until Release and records
// when each other caller entered.
type HoldUpstream struct {
	release chan struct{}
	once    sync.Once
	entered chan string // who, in order of entry
	mu      sync.Mutex
	at      map[string]time.Time
}

func NewHoldUpstream() *HoldUpstream {
	return &HoldUpstream{release: make(chan struct{}), entered: make(chan string, 64), at: map[string]time.Time{}}
}

// Release lets the holder go; safe to call more than once.
func (u *HoldUpstream) Release() { u.once.Do(func() { close(u.release) }) }

// StartHolder sends the holder's request to url and returns once it holds
// the lock; it is released when the test ends.
func StartHolder(t testing.TB, up *HoldUpstream, url string) <-chan FetchResult {
	t.Helper()
	holder := GoFetch(context.Background(), url+"?who=holder")
	t.Cleanup(up.Release)
	if who, ok := up.NextEntered(10 * time.Second); !ok || who != "holder" {
		t.Fatalf("holder did not get the lock (entered %q)", who)
	}
	return holder
}

func (u *HoldUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	who := r.URL.Query().Get("who")
	u.mu.Lock()
	u.at[who] = time.Now()
	u.mu.Unlock()
	select {
	case u.entered <- who:
	default:
	}
	if who == "holder" {
		<-u.release
	}
	return nil
}

// EnteredAt is when who (last) entered the upstream.
func (u *HoldUpstream) EnteredAt(who string) (time.Time, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	at, ok := u.at[who]
	return at, ok
}

// NextEntered waits (at most d) for the next caller to enter the upstream.
func (u *HoldUpstream) NextEntered(d time.Duration) (string, bool) {
	select {
	case who := <-u.entered:
		return who, true
	case <-time.After(d):
		return "", false
	}
}

// ExclusivityUpstream counts requests in flight per key (path) and
// records the fencing tokens (Lock-Fencing-Token) in the order it sees
// them; each request takes hold.
type ExclusivityUpstream struct {
	hold time.Duration

	mu       sync.Mutex
	inflight map[string]int
	maxSeen  map[string]int
	tokens   map[string][]int64
	served   int
}

func NewExclusivityUpstream(hold time.Duration) *ExclusivityUpstream {
	return &ExclusivityUpstream{hold: hold, inflight: map[string]int{}, maxSeen: map[string]int{}, tokens: map[string][]int64{}}
}

func (u *ExclusivityUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	key := r.URL.Path
	tok, err := strconv.ParseInt(r.Header.Get("Lock-Fencing-Token"), 10, 64)
	u.mu.Lock()
	u.inflight[key]++
	if u.inflight[key] > u.maxSeen[key] {
		u.maxSeen[key] = u.inflight[key]
	}
	if err == nil {
		u.tokens[key] = append(u.tokens[key], tok)
	} else {
		u.tokens[key] = append(u.tokens[key], -1)
	}
	u.mu.Unlock()
	time.Sleep(u.hold)
	u.mu.Lock()
	u.inflight[key]--
	u.served++
	u.mu.Unlock()
	w.Header().Set("X-Fence", r.Header.Get("Lock-Fencing-Token"))
	w.WriteHeader(http.StatusOK)
	return nil
}

// Served is how many requests it has answered.
func (u *ExclusivityUpstream) Served() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.served
}

// Check fails the test when a key ever had two holders or its tokens did
// not strictly increase in upstream order.
func (u *ExclusivityUpstream) Check(t testing.TB) {
	t.Helper()
	u.mu.Lock()
	defer u.mu.Unlock()
	for k, m := range u.maxSeen {
		if m > 1 {
			t.Errorf("key %s: %d requests in flight at once, want at most 1", k, m)
		}
	}
	for k, toks := range u.tokens {
		for i := 1; i < len(toks); i++ {
			if toks[i] <= toks[i-1] {
				t.Errorf("key %s: fencing token %d after %d: not strictly increasing (tokens %v)", k, toks[i], toks[i-1], toks)
				break
			}
		}
	}
}

// PooledFor returns the pooled client behind a provisioned handler's pool
// key (without changing its reference count for long).
func PooledFor(t testing.TB, key string) *shared.Client {
	t.Helper()
	v, loaded, err := shared.ClientPool.LoadOrNew(key, func() (caddy.Destructor, error) {
		return nil, errors.New("not pooled")
	})
	if err != nil || !loaded {
		t.Fatalf("pool key %s: loaded %v, %v", key, loaded, err)
	}
	_, _ = shared.ClientPool.Delete(key)
	return v.(*shared.Client)
}

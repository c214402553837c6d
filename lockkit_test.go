package redisdlm

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
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddyserver/caddy/v2"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
)

// The lock's test helpers that the root's tests of a whole Caddy or of the
// lock with another module share (as redislock's tests have them; the root
// reaches the lock through its exported API only).

// wakeHTTP is the client of these tests: keep-alive for many concurrent
// closed-loop clients, and a bound on every request.
var wakeHTTP = &http.Client{
	Transport: &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 64},
	Timeout:   45 * time.Second,
}

// wakeFetch sends one GET and returns its status and headers; it never
// touches testing.T, so it is safe in goroutines that may outlive a
// failing test's main body.
func wakeFetch(ctx context.Context, url string) (int, http.Header, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := wakeHTTP.Do(req)
	if err != nil {
		return 0, nil, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header, nil
}

// fetchResult is the outcome of one request sent in the background.
type fetchResult struct {
	status int
	hdr    http.Header
	err    error
	took   time.Duration
}

// goFetch sends a GET in the background; the channel gets exactly one result.
func goFetch(ctx context.Context, url string) <-chan fetchResult {
	ch := make(chan fetchResult, 1)
	go func() {
		start := time.Now()
		s, h, err := wakeFetch(ctx, url)
		ch <- fetchResult{status: s, hdr: h, err: err, took: time.Since(start)}
	}()
	return ch
}

// await waits for a background request, at most d.
func await(t *testing.T, ch <-chan fetchResult, d time.Duration, what string) fetchResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(d):
		t.Errorf("%s: no answer within %s", what, d)
		return fetchResult{err: fmt.Errorf("no answer within %s", d)}
	}
}

// waitFor polls cond every 5ms until it holds or d has passed.
func waitFor(d time.Duration, cond func() bool) bool { return testredis.WaitFor(d, cond) }

// lockCfg builds a redis_lock JSON config on one Redis server.
func lockCfg(addr, extra string) string {
	if extra == "" {
		return fmt.Sprintf(`{"redis":[%q]}`, addr)
	}
	return fmt.Sprintf(`{"redis":[%q],%s}`, addr, extra)
}

// holdUpstream blocks requests with ?who=holder until release is closed and
// records when each other caller entered.
type holdUpstream struct {
	release chan struct{}
	once    sync.Once
	entered chan string // who, in order of entry
	mu      sync.Mutex
	at      map[string]time.Time
}

func newHoldUpstream() *holdUpstream {
	return &holdUpstream{release: make(chan struct{}), entered: make(chan string, 64), at: map[string]time.Time{}}
}

// Release lets the holder go; safe to call more than once.
func (u *holdUpstream) Release() { u.once.Do(func() { close(u.release) }) }

// startHolder sends the holder's request to url and returns once it holds
// the lock; it is released when the test ends.
func startHolder(t *testing.T, up *holdUpstream, url string) <-chan fetchResult {
	t.Helper()
	holder := goFetch(context.Background(), url+"?who=holder")
	t.Cleanup(up.Release)
	if who, ok := up.nextEntered(10 * time.Second); !ok || who != "holder" {
		t.Fatalf("holder did not get the lock (entered %q)", who)
	}
	return holder
}

func (u *holdUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
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

// nextEntered waits (at most d) for the next caller to enter the upstream.
func (u *holdUpstream) nextEntered(d time.Duration) (string, bool) {
	select {
	case who := <-u.entered:
		return who, true
	case <-time.After(d):
		return "", false
	}
}

// exclusivityUpstream counts requests in flight per key and records the
// fencing tokens in the order it sees them.
type exclusivityUpstream struct {
	hold time.Duration

	mu       sync.Mutex
	inflight map[string]int
	maxSeen  map[string]int
	tokens   map[string][]int64
	served   int
}

func newExclusivityUpstream(hold time.Duration) *exclusivityUpstream {
	return &exclusivityUpstream{hold: hold, inflight: map[string]int{}, maxSeen: map[string]int{}, tokens: map[string][]int64{}}
}

func (u *exclusivityUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
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

// check fails the test when a key ever had two holders or its tokens did
// not strictly increase in upstream order.
func (u *exclusivityUpstream) check(t *testing.T) {
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

// lostCount reads caddy_redis_lock_lost_total of one handler.
func lostCount(handler string) float64 {
	var m dto.Metric
	_ = shared.LockLostTotal.WithLabelValues(handler).Write(&m)
	return m.GetCounter().GetValue()
}

// heldBy reports how many holders a lock key has on r.
func heldBy(r *testRedis, key string) int64 {
	n, _ := r.Client().ZCard(context.Background(), key).Result()
	return n
}

// startRedlock starts n independent redis-servers and returns them with the
// JSON list of their addresses.
func startRedlock(t *testing.T, n int) ([]*testRedis, string) {
	t.Helper()
	return testredis.StartRedlock(t, n)
}

// lockClient is the pooled Redis client of a provisioned lock handler on
// one logical Redis: the pool names a client by its connection settings.
func lockClient(t *testing.T, h *redislock.RedisLock) redis.UniversalClient {
	t.Helper()
	settings, err := h.RedisConfig.Resolve()
	if err != nil || len(settings) != 1 {
		t.Fatalf("the lock's connection settings: %v %v", settings, err)
	}
	return pooledFor(t, settings[0].PoolKey()).Redis
}

// pooledFor returns the pooled client behind a provisioned handler's pool
// key (without changing its reference count for long).
func pooledFor(t *testing.T, key string) *shared.Client {
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

package redislock

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// lockDelay is the lock_delay of these tests.
const lockDelay = 1500 * time.Millisecond

// delayedCfg is a redis_lock config on addrs with lock_delay and the given
// ttl and wait.
func delayedCfg(addrs, ttl, wait string) string {
	return fmt.Sprintf(`{"redis":%s,"ttl":%q,"wait":%q,"timeout":"2s","backoff_min":"10ms","backoff_max":"100ms","lock_delay":%q}`,
		addrs, ttl, wait, lockDelay.String())
}

// entryTimes is an upstream that records when each request (by ?n=) came
// in and, for ?block=1, holds it until its client goes away (recording
// when it saw that).
type entryTimes struct {
	mu      sync.Mutex
	entered map[string]time.Time
	gone    map[string]time.Time
	in      chan string
}

func newEntryTimes() *entryTimes {
	return &entryTimes{entered: map[string]time.Time{}, gone: map[string]time.Time{}, in: make(chan string, 16)}
}

func (u *entryTimes) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	n := r.URL.Query().Get("n")
	u.mu.Lock()
	u.entered[n] = time.Now()
	u.mu.Unlock()
	u.in <- n
	if r.URL.Query().Get("block") == "1" {
		select {
		case <-r.Context().Done():
			u.mu.Lock()
			u.gone[n] = time.Now()
			u.mu.Unlock()
			return r.Context().Err()
		case <-time.After(20 * time.Second):
		}
	}
	w.WriteHeader(http.StatusOK)
	return nil
}

func (u *entryTimes) at(m map[string]time.Time, n string) time.Time {
	u.mu.Lock()
	defer u.mu.Unlock()
	return m[n]
}

// awaitEntry waits for request n to reach the upstream.
func (u *entryTimes) awaitEntry(t *testing.T, n string) {
	t.Helper()
	deadline := time.After(15 * time.Second)
	for {
		select {
		case got := <-u.in:
			if got == n {
				return
			}
		case <-deadline:
			t.Fatalf("request %s never reached the upstream", n)
		}
	}
}

// sendAsync sends a GET and delivers its status (0 on a transport error).
func sendAsync(ctx context.Context, url string) <-chan int {
	ch := make(chan int, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			ch <- 0
			return
		}
		resp.Body.Close()
		ch <- resp.StatusCode
	}()
	return ch
}

// waitQueued waits until a request of h waits for key in this instance.
func waitQueued(t *testing.T, h *RedisLock, key string) {
	t.Helper()
	if !waitFor(15*time.Second, func() bool { w, _ := h.locker.Local(key); return w > 0 }) {
		t.Fatal("the waiter never queued")
	}
}

// delayExpires fails when a server keeps the key's lock_delay entries
// without an expiry.
func delayExpires(t *testing.T, rs []*testRedis, key string) {
	t.Helper()
	for _, r := range rs {
		if ttl := r.Client().PTTL(context.Background(), lock.DelayKey(key)).Val(); ttl == -1 {
			t.Errorf("%s: %s has no expiry", r, lock.DelayKey(key))
		}
	}
}

// TestLockDelayAfterForceRelease: a lock force-released through the admin
// API is granted to nobody for lock_delay; then the waiter gets it.
func TestLockDelayAfterForceRelease(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, _ []*testRedis, addrs string) {
		stuck := provisionLock(t, delayedCfg(addrs, "30s", "0s"))
		h := provisionLock(t, delayedCfg(addrs, "20s", "10s"))
		up := newEntryTimes()
		srv := handlerServer(t, h, up.ServeHTTP)
		key := shared.StoredKey(h.Prefix, "/forced")
		ls, err := stuck.locker.Acquire(context.Background(), []string{key})
		if err != nil {
			t.Fatal(err)
		}
		defer ls.Release()
		status := sendAsync(context.Background(), srv.URL+"/forced?n=B")
		waitQueued(t, h, key)
		released := time.Now()
		rec := httptest.NewRecorder()
		if err := h.releaseLock(rec, httptest.NewRequest("POST", "/redisdlm/locks/0/%2Fforced/release", nil), &shared.AdminEntry{Handler: h}, "/forced"); err != nil || rec.Code != 200 {
			t.Fatalf("force release: %v %d %s", err, rec.Code, rec.Body)
		}
		if s := <-status; s != 200 {
			t.Fatalf("the waiter got %d, want 200 once the delay ended", s)
		}
		if got := up.at(up.entered, "B").Sub(released); got < lockDelay {
			t.Errorf("the waiter got the lock %s after the force release; want at least lock_delay %s", got, lockDelay)
		}
		if n := delayCount(h.label, "forced"); n != 1 {
			t.Errorf(`caddy_redis_lock_delays_total{result="forced"} = %v, want 1`, n)
		}
	})
}

// TestLockDelayNotAfterCleanRelease: a clean release has no delay: with
// wait 0, requests in a row all get the lock at once.
func TestLockDelayNotAfterCleanRelease(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, _ []*testRedis, addrs string) {
		h := provisionLock(t, delayedCfg(addrs, "30s", "0s"))
		srv := handlerServer(t, h, okHandler)
		for i := 0; i < 20; i++ {
			if resp, body := get(t, srv.URL+"/clean"); resp == nil || resp.StatusCode != 200 {
				t.Fatalf("request %d after a clean release: %v %q, want 200 at once", i, resp, body)
			}
		}
	})
}

// TestLockDelayAfterClientGone: a holder whose client went away while the
// route still ran (its upstream may still be writing) gives the lock back
// with lock_delay: the waiter gets it no sooner.
func TestLockDelayAfterClientGone(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, rs []*testRedis, addrs string) {
		h := provisionLock(t, delayedCfg(addrs, "30s", "10s"))
		up := newEntryTimes()
		srv := handlerServer(t, h, up.ServeHTTP)
		key := shared.StoredKey(h.Prefix, "/gone")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		first := sendAsync(ctx, srv.URL+"/gone?n=A&block=1")
		up.awaitEntry(t, "A")
		status := sendAsync(context.Background(), srv.URL+"/gone?n=B")
		waitQueued(t, h, key)
		cancel() // the client of A goes away while its route runs
		recvWithin(t, first, 30*time.Second, "the answer of A")
		if s := <-status; s != 200 {
			t.Fatalf("the waiter got %d, want 200 once the delay ended", s)
		}
		gone := up.at(up.gone, "A")
		if gone.IsZero() {
			t.Fatal("the route never saw its client go away")
		}
		if got := up.at(up.entered, "B").Sub(gone); got < lockDelay {
			t.Errorf("the waiter got the lock %s after the holder's client went away; want at least lock_delay %s", got, lockDelay)
		}
		delayExpires(t, rs, key)
		if n := delayCount(h.label, "abandoned"); n != 1 {
			t.Errorf(`caddy_redis_lock_delays_total{result="abandoned"} = %v, want 1`, n)
		}
	})
}

// delayCount reads caddy_redis_lock_delays_total of a handler and result.
func delayCount(handler, result string) float64 {
	var m dto.Metric
	_ = shared.LockDelays.WithLabelValues(handler, result).Write(&m)
	return m.GetCounter().GetValue()
}

// TestLockDelayConfig: lock_delay in the Caddyfile and JSON; a negative one
// is an error naming the directive, the subdirective and the line.
func TestLockDelayConfig(t *testing.T) {
	t.Parallel()
	h := new(RedisLock)
	d := caddyfile.NewTestDispenser("redis_lock {\n\tlock_delay 2s\n}")
	if err := h.UnmarshalCaddyfile(d); err != nil || time.Duration(h.LockDelay) != 2*time.Second {
		t.Fatalf("lock_delay 2s: %v %v", err, time.Duration(h.LockDelay))
	}
	for _, in := range []string{"lock_delay -1s", "lock_delay soon", "lock_delay", "lock_delay 1s 2s"} {
		err := new(RedisLock).UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\t" + in + "\n}"))
		if err == nil || !strings.Contains(err.Error(), "redis_lock: lock_delay:") || !strings.Contains(err.Error(), "Testfile:2") {
			t.Errorf("%q: %v, want an error naming redis_lock, lock_delay and the line", in, err)
		}
	}
	twice := new(RedisLock).UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\tlock_delay 1s\n\tlock_delay 2s\n}"))
	if twice == nil || !strings.Contains(twice.Error(), "lock_delay: given twice") {
		t.Errorf("lock_delay twice: %v", twice)
	}
	err := (&RedisLock{LockDelay: -1}).Validate()
	if err == nil || !strings.Contains(err.Error(), "redis_lock: lock_delay: must not be negative") {
		t.Errorf("JSON lock_delay -1ns: %v", err)
	}
}

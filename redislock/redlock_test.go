package redislock

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// startRedlock starts n independent redis-servers and returns them with the
// JSON list of their addresses.
var startRedlock = testredis.StartRedlock

// onOneAndThreeServers runs f as parallel subtests on one Redis server and
// on a Redlock of three (rs and their addresses as a JSON list).
func onOneAndThreeServers(t *testing.T, f func(t *testing.T, rs []*testRedis, addrs string)) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d servers", n), func(t *testing.T) {
			t.Parallel()
			rs, addrs := startRedlock(t, n)
			f(t, rs, addrs)
		})
	}
}

// hammer sends n concurrent requests (conc at a time) alternating over the
// servers and fails on any non-200.
func hammerLock(t *testing.T, n, conc int, urls ...string) {
	t.Helper()
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			resp, body := get(t, urls[i%len(urls)])
			if resp == nil || resp.StatusCode != 200 {
				t.Errorf("request %d: %v %s", i, resp, body)
			}
		}(i)
	}
	wg.Wait()
}

// TestRedlockMinorityDown: with one of three servers paused (SIGSTOP) or
// killed, locking goes on, stays exclusive, and a lone request's lock
// latency is bounded by the call timeout, not by wait.
func TestRedlockMinorityDown(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"paused", "killed"} {
		t.Run(mode, func(t *testing.T) {
			rs, addrs := startRedlock(t, 3)
			up := testkit.NewExclusivityUpstream(time.Millisecond)
			a := provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"800ms","wait":"30s"}`, addrs))
			b := provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"801ms","wait":"30s"}`, addrs))
			sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
			if mode == "paused" {
				rs[1].Pause()
				defer rs[1].Resume()
			} else {
				rs[1].Kill()
			}
			start := time.Now()
			resp, body := get(t, sa.URL+"/solo")
			if resp == nil || resp.StatusCode != 200 {
				t.Fatalf("one server %s: %v %s", mode, resp, body)
			}
			if el := time.Since(start); el > 4*time.Second {
				t.Errorf("uncontended request took %s with one server %s; want about the 800ms timeout at most", el, mode)
			}
			hammerLock(t, 120, 24, sa.URL+"/k", sb.URL+"/k")
			up.Check(t)
		})
	}
}

// TestRedlockMajorityDown: with two of three paused, requests get 503 (or
// pass with fail_open) within 2 × timeout; when they come back, locking
// works again without a reload.
func TestRedlockMajorityDown(t *testing.T) {
	t.Parallel()
	rs, addrs := startRedlock(t, 3)
	closed := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"300ms","wait":"20s"}`, addrs)), okHandler)
	open := handlerServer(t, provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"301ms","wait":"20s","fail_open":true}`, addrs)), okHandler)
	rs[0].Pause()
	rs[2].Pause()
	for _, c := range []struct {
		url  string
		want int
	}{{closed.URL, 503}, {open.URL, 200}} {
		start := time.Now()
		resp, body := get(t, c.url+"/m")
		el := time.Since(start)
		if resp == nil || resp.StatusCode != c.want {
			t.Errorf("majority paused: %v %s, want %d", resp, body, c.want)
		}
		// 2 × 300ms, with room for a loaded machine; far below the 20s wait.
		if el > 2*time.Second {
			t.Errorf("answered after %s; want within about 2 × timeout", el)
		}
	}
	rs[0].Resume()
	rs[2].Resume()
	until200(t, closed.URL+"/m", 10*time.Second, "no recovery after the servers came back")
}

// TestRedlockRestartEmptyKeepsTokensIncreasing: 1000 acquisitions of one
// key through two instances while one server is killed and restarted empty
// midway: the upstream never sees two holders, and tokens strictly
// increase.
func TestRedlockRestartEmptyKeepsTokensIncreasing(t *testing.T) {
	t.Parallel()
	rs, addrs := startRedlock(t, 3)
	up := testkit.NewExclusivityUpstream(0)
	a := provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"400ms","wait":"60s"}`, addrs))
	b := provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"401ms","wait":"60s"}`, addrs))
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
	var done atomic.Int32
	stop := make(chan struct{})
	go func() {
		defer close(stop)
		for done.Load() < 400 {
			time.Sleep(5 * time.Millisecond)
		}
		rs[0].Kill()
		time.Sleep(200 * time.Millisecond)
		rs[0].Restart()
	}()
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for i := 0; i < 1000; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			url := sa.URL
			if i%2 == 1 {
				url = sb.URL
			}
			resp, body := get(t, url+"/hot")
			if resp == nil || resp.StatusCode != 200 {
				t.Errorf("request %d: %v %s", i, resp, body)
			}
			done.Add(1)
		}(i)
	}
	wg.Wait()
	<-stop
	up.Check(t)
	if up.Served() != 1000 {
		t.Errorf("served %d, want 1000", up.Served())
	}
}

// TestRedlockLeaseLostOnMajority: a holder whose lease disappears on a
// majority is told at its next extension (on_lost cancel: 503).
func TestRedlockLeaseLostOnMajority(t *testing.T) {
	t.Parallel()
	rs, addrs := startRedlock(t, 3)
	entered := make(chan struct{})
	up := func(w http.ResponseWriter, r *http.Request) error {
		close(entered)
		select {
		case <-r.Context().Done():
			return r.Context().Err()
		case <-time.After(5 * time.Second):
			return nil
		}
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"ttl":"900ms"}`, addrs))
	srv := handlerServer(t, h, up)
	done := make(chan *http.Response, 1)
	go func() { resp, _ := get(t, srv.URL+"/lost"); done <- resp }()
	recvWithin(t, (<-chan struct{})(entered), 15*time.Second, "the request reaching the upstream")
	key := shared.StoredKey(h.Prefix, "/lost")
	// Take the lease away on two servers and give it to someone else there.
	for _, r := range rs[:2] {
		c := r.Client()
		c.Del(context.Background(), key)
		c.ZAdd(context.Background(), key, redisZ(time.Now().Add(time.Minute), "thief"))
	}
	resp := recvWithin(t, done, 30*time.Second, "the answer")
	if resp == nil || resp.StatusCode != 503 {
		t.Fatalf("lease lost on the majority: %v, want 503", resp)
	}
}

// TestRedlockEvenCountRejected: an even server count is a config error that
// says why.
func TestRedlockEvenCountRejected(t *testing.T) {
	h := new(RedisLock)
	h.Addresses = []string{"127.0.0.1:1", "127.0.0.1:2"}
	err := h.Validate()
	if err == nil || !strings.Contains(err.Error(), "odd") {
		t.Fatalf("even count: %v", err)
	}
}

// TestRedlockExtensionRecreatesOnRestartedServer: servers that restart empty
// while a lease is held get the lease back on the next extension, so two
// restarts one after the other do not erode the lock: it stays exclusive
// and its holder is not told it lost it.
func TestRedlockExtensionRecreatesOnRestartedServer(t *testing.T) {
	// Not parallel: its 900 ms lease must be extended in time, which a machine busy with 15 other tests cannot promise.
	rs, addrs := startRedlock(t, 3)
	entered := make(chan struct{})
	finish := make(chan struct{})
	var canceled atomic.Bool
	up := func(w http.ResponseWriter, r *http.Request) error {
		if r.URL.Query().Get("who") != "holder" {
			return nil
		}
		close(entered)
		select {
		case <-finish:
		case <-r.Context().Done():
			canceled.Store(true)
		}
		return nil
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"ttl":"900ms","timeout":"500ms"}`, addrs))
	other := provisionLock(t, fmt.Sprintf(`{"redis":%s,"ttl":"900ms","timeout":"501ms","wait":0}`, addrs))
	srv, osrv := handlerServer(t, h, up), handlerServer(t, other, up)
	done := make(chan *http.Response, 1)
	go func() { resp, _ := get(t, srv.URL+"/r?who=holder"); done <- resp }()
	recvWithin(t, entered, 15*time.Second, "the holder reaching the upstream")
	key := shared.StoredKey(h.Prefix, "/r")
	for _, i := range []int{0, 1} {
		rs[i].Restart()
		deadline := time.Now().Add(5 * time.Second)
		for {
			n, _ := rs[i].Client().ZCard(context.Background(), key).Result()
			if n == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("server %d restarted empty and did not get the lease back by extension", i)
			}
			time.Sleep(50 * time.Millisecond)
		}
		if resp, _ := get(t, osrv.URL+"/r?who=other"); resp == nil || resp.StatusCode != 423 {
			t.Fatalf("after server %d restarted, another request got %v; want 423 (the lock is held)", i, resp)
		}
	}
	close(finish)
	if resp := <-done; resp == nil || resp.StatusCode != 200 || canceled.Load() {
		t.Fatalf("holder: %v canceled=%v; want 200, lease kept", resp, canceled.Load())
	}
}

// TestRedlockPermitsRejected: a semaphore over a Redlock quorum is refused:
// each server counts its own holders, so holders granted by different
// majorities (A+B, B+C, A+C) could be more than the permits (the soak saw
// three holders of a permits-2 key with no fault running).
func TestRedlockPermitsRejected(t *testing.T) {
	t.Parallel()
	h := new(RedisLock)
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\tredis 127.0.0.1:1 127.0.0.1:2 127.0.0.1:3\n\tpermits 2\n}"))
	if err == nil || !strings.Contains(err.Error(), "redis_lock: permits") || !strings.Contains(err.Error(), ":2") {
		t.Fatalf("Caddyfile: %v, want an error naming redis_lock, permits and the line", err)
	}
	j := &RedisLock{Permits: 2}
	j.Addresses = []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
	if err := j.Validate(); err == nil || !strings.Contains(err.Error(), "permits") {
		t.Fatalf("JSON: %v, want a permits error", err)
	}
}

package redislock

import (
	"context"
	"fmt"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/redis/go-redis/v9"
)

// connectedClients reads connected_clients from INFO through c (its own
// connection included).
func connectedClients(t *testing.T, c *redis.Client) int {
	return int(infoInt(t, c, "clients", "connected_clients"))
}

// warmLock is a lock handler (timeout 5s, wait 0) on a Redis of its own,
// served, after one request.
func warmLock(t *testing.T) (*testRedis, *RedisLock, *httptest.Server) {
	t.Helper()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"5s","wait":"0s"`))
	s := handlerServer(t, h, okHandler)
	if resp, _ := get(t, s.URL+"/warm"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("warm-up: %v", resp)
	}
	return r, h, s
}

// pausedBurst makes a lock handler's pool grow as a slow Redis does: n
// calls on the handler's shared client meet a paused Redis, each holding a
// connection of its own (the calls that go outside the pipe, redisconn.Pipe:
// extensions, sync_replicas acquires, wait-queue updates), while n locked
// requests wait in the pipe; all succeed once it resumes. It returns the
// handler's server, a client of the test's own and connected_clients
// before and after the burst.
func pausedBurst(t *testing.T, n int) (srv string, rc *redis.Client, base, after int) {
	t.Helper()
	r, h, s := warmLock(t)
	rc = r.Client()
	base = connectedClients(t, rc)
	shared := h.locker.Clients()[0]
	r.Pause()
	var done []<-chan testkit.FetchResult
	pings := make(chan error, n)
	for i := 0; i < n; i++ {
		done = append(done, testkit.GoFetch(context.Background(), fmt.Sprintf("%s/k%d", s.URL, i)))
		go func() { pings <- shared.Ping(context.Background()).Err() }()
	}
	// Every ping waits on a connection of its own: wait until Redis has
	// accepted them all (the kernel completes the handshakes).
	waitFor(3*time.Second, func() bool { return int(shared.PoolStats().TotalConns) >= n })
	r.Resume()
	for i, ch := range done {
		if res := testkit.Await(t, ch, 20*time.Second, fmt.Sprintf("request %d", i)); res.Status != 200 {
			t.Fatalf("request %d: %d %v", i, res.Status, res.Err)
		}
	}
	for i := 0; i < n; i++ {
		if err := <-pings; err != nil {
			t.Fatalf("ping %d: %v", i, err)
		}
	}
	after = connectedClients(t, rc)
	if after < base+n/2 {
		t.Fatalf("%d connections after %d calls met a paused Redis, %d before: the burst did not grow the pool", after, n, base)
	}
	return s.URL, rc, base, after
}

// TestPausedRedisLeavesLockPoolSmall: locked requests that meet a paused
// Redis wait in the pipe (redisconn.Pipe) instead of each taking a
// connection of its own: the pool grows by at most the pipelines in flight
// and the background release, and every request is served once Redis
// resumes.
func TestPausedRedisLeavesLockPoolSmall(t *testing.T) {
	t.Parallel()
	r, h, s := warmLock(t)
	rc := r.Client()
	base := connectedClients(t, rc)
	r.Pause()
	const n = 48
	var done []<-chan testkit.FetchResult
	for i := 0; i < n; i++ {
		done = append(done, testkit.GoFetch(context.Background(), fmt.Sprintf("%s/p%d", s.URL, i)))
	}
	if !waitFor(5*time.Second, func() bool { return h.locker.QueuedCalls() >= n-redisconn.PipeInFlight }) {
		r.Resume()
		t.Fatalf("%d of %d locked requests queued in the pipe after 5s of a paused Redis, want %d: the test never met its premise", h.locker.QueuedCalls(), n, n-redisconn.PipeInFlight)
	}
	r.Resume()
	for i, ch := range done {
		if res := testkit.Await(t, ch, 20*time.Second, fmt.Sprintf("request %d", i)); res.Status != 200 {
			t.Fatalf("request %d: %d %v", i, res.Status, res.Err)
		}
	}
	if c := connectedClients(t, rc); c > base+redisconn.PipeInFlight+1 {
		t.Fatalf("%d connections after %d locked requests met a paused Redis, %d before: want at most %d more (the pipelines in flight and the release)",
			c, n, base, redisconn.PipeInFlight+1)
	}
}

// TestPoolShrinksAfterSlowRedis: while Redis is paused, every request holds
// a connection of its own; once those were idle for redisconn.ConnMaxIdle
// (shortened here), they are closed, so the connections come back to about
// what the traffic needs. Not parallel: it shortens redisconn.ConnMaxIdle
// for the clients made meanwhile.
func TestPoolShrinksAfterSlowRedis(t *testing.T) {
	defer func(d time.Duration) { redisconn.ConnMaxIdle = d }(redisconn.ConnMaxIdle)
	redisconn.ConnMaxIdle = 500 * time.Millisecond
	srv, rc, base, after := pausedBurst(t, 48)
	time.Sleep(redisconn.ConnMaxIdle + 200*time.Millisecond)
	for i := 0; i < 30; i++ {
		if resp, _ := get(t, fmt.Sprintf("%s/q%d", srv, i)); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("after the quiet spell: %v", resp)
		}
	}
	// At worst (the reaper not yet done) a call that finds only expired
	// connections closes three and dials one.
	if c := connectedClients(t, rc); c > base+(after-base+2)/3+1 {
		t.Errorf("%d connections after a quiet spell longer than redisconn.ConnMaxIdle (%d before the burst, %d after it); the expired idle ones were not closed", c, base, after)
	}
	t.Logf("connections: %d before, %d after 48 requests met a paused Redis, %d after a quiet spell", base, after, connectedClients(t, rc))
}

// TestPoolClosesIdleWithoutTraffic: after the burst of a paused Redis, no
// call comes at all, and still the idle connections are closed once idle
// for redisconn.ConnMaxIdle (plus the reaper's sweeps). go-redis closes an
// idle connection only when a call takes it, three per call: before the
// reaper, a quiet Caddy kept every connection a burst opened (the soak,
// seed 605460989: a Redlock server at 186 connections after a quiet
// minute and a few probes, 22 before the faults). Not parallel: it
// shortens redisconn.ConnMaxIdle.
func TestPoolClosesIdleWithoutTraffic(t *testing.T) {
	defer func(d time.Duration) { redisconn.ConnMaxIdle = d }(redisconn.ConnMaxIdle)
	redisconn.ConnMaxIdle = 500 * time.Millisecond
	_, rc, base, after := pausedBurst(t, 48)
	// base counts the warm-up's connection, closed too by now.
	if !waitFor(10*time.Second, func() bool { return connectedClients(t, rc) <= base }) {
		t.Fatalf("%d connections 10s after a burst (%d before it, %d after it) with no call since; want them closed after %v idle",
			connectedClients(t, rc), base, after, redisconn.ConnMaxIdle)
	}
}

// TestPoolDialsNothingUnderSteadyLoad: 64 callers lock and release keys
// for a few thousand passes (more calls in flight than the 16 idle
// connections the pool used to keep): after a warm-up, Redis accepts no new
// connection. Before, every connection handed back beyond 16 idle ones was
// closed and the next call dialled again: about one new connection per
// two locked requests.
func TestPoolDialsNothingUnderSteadyLoad(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, testkit.LockConfig(r.Addr, `"timeout":"5s","wait":"10s"`))
	pass := func(from, n int) {
		var wg sync.WaitGroup
		for i := range 64 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := range n {
					ls, err := h.locker.Acquire(t.Context(), []string{shared.StoredKey(h.Prefix, fmt.Sprintf("k%d-%d", i, (from+j)%50))})
					if err != nil {
						t.Error(err)
						return
					}
					ls.Release()
				}
			}()
		}
		wg.Wait()
	}
	rc := r.Client()
	// Warm-up until a whole pass opens nothing: the pool grows to what 64
	// callers need (one pass is not always enough under CPU load from
	// outside the test; a pool that churns never gets there).
	stable := false
	for w := 0; w < 5 && !stable; w++ {
		before := infoInt(t, rc, "stats", "total_connections_received")
		pass(w*20, 20)
		stable = infoInt(t, rc, "stats", "total_connections_received") == before
	}
	if !stable {
		t.Fatal("the pool still opened Redis connections in the fifth warm-up pass of 64 callers")
	}
	before := infoInt(t, rc, "stats", "total_connections_received")
	pass(20, 60)
	if d := infoInt(t, rc, "stats", "total_connections_received") - before; d != 0 {
		t.Fatalf("%d new Redis connections during 3840 lock-release passes of 64 callers after a warm-up; want 0", d)
	}
}

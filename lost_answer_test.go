package redisdlm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
)

// delayProxy forwards TCP to a Redis; while armed, a chunk from the client
// that contains match is held back for delay before it goes on (a packet
// retransmitted or stuck on one connection, while others flow).
type delayProxy struct {
	addr  string
	armed atomic.Bool
	// held counts the chunks held back, each counted as its hold ends
	// (it is forwarded right after).
	held atomic.Int32
}

func startDelayProxy(t *testing.T, target string, match []byte, delay time.Duration) *delayProxy {
	t.Helper()
	p := new(delayProxy)
	p.addr = startInterceptProxy(t, target, func(chunk []byte, _, _ net.Conn) bool {
		if p.armed.Load() && bytes.Contains(chunk, match) {
			time.Sleep(delay)
			p.held.Add(1)
		}
		return true
	})
	return p
}

// awaitHeldBack waits until the proxy's hold of a chunk has ended (failing
// the test when it never does within d), then a moment more for the chunk
// to reach Redis and run there: the test then checks what it left, not what it has not
// reached yet.
func (p *delayProxy) awaitHeldBack(t *testing.T, d time.Duration) {
	t.Helper()
	if !waitFor(d, func() bool { return p.held.Load() >= 1 }) {
		t.Fatalf("the held-back command never went on to Redis within %v", d)
	}
	time.Sleep(200 * time.Millisecond)
}

// startInterceptProxy forwards TCP connections to target; every chunk a
// client sends goes through intercept first, which may hold it, act on the
// two connections, and says whether the chunk is forwarded (false: the
// connection forwards nothing more). It returns the proxy's address.
func startInterceptProxy(t *testing.T, target string, intercept func(chunk []byte, client, server net.Conn) bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			t.Cleanup(func() { c.Close(); s.Close() })
			go func() { io.Copy(c, s); c.Close() }()
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if !intercept(buf[:n], c, s) {
							return
						}
						s.Write(buf[:n])
					}
					if err != nil {
						s.Close()
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// warmThenArm takes and releases key once through h (the connections and
// the script are ready, so the next acquire's packet is the one held
// back), waits until the key is free on every server in rs (on a loaded
// machine the warm-up's release can outlast the short timeout and end in
// the background), then arms the proxy.
func (p *delayProxy) warmThenArm(t *testing.T, h *RedisLock, key string, rs ...*testRedis) {
	t.Helper()
	// The first call dials, checks the server and loads the script: on a
	// loaded machine that can take longer than the test's short timeout, so
	// the warm-up tries again (it is not what the test is about).
	var err error
	for try := 0; try < 20; try++ {
		var warm *lease
		if warm, err = h.locker.Acquire(context.Background(), []string{key}); err == nil {
			warm.Release()
			if !freeWithin(10*time.Second, key, rs...) {
				t.Fatal("warm-up: the key stayed held after its release")
			}
			p.armed.Store(true)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("warm-up: %v", err)
}

// TestNoOrphanAfterDelayedAcquire: an acquire that reaches Redis only after
// the client gave up on it and undid it (its packet held back past the
// timeout) takes nothing: the undo marked its token dead. Before, a delay
// longer than the undo's confirmation left the key held for its whole ttl
// by a token nobody owns.
func TestNoOrphanAfterDelayedAcquire(t *testing.T) {
	t.Parallel()
	for _, delay := range []time.Duration{450 * time.Millisecond, 1500 * time.Millisecond} {
		t.Run(delay.String(), func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			p := startDelayProxy(t, r.Addr, []byte(lock.AcquireScript.Hash()), delay)
			h := provisionLock(t, fmt.Sprintf(`{"redis":[%q],"timeout":"300ms","wait":"0s","ttl":"20s"}`, p.addr))
			key := storedKey(h.Prefix, "/pay")
			p.warmThenArm(t, h, key, r)
			if _, err := h.locker.Acquire(context.Background(), []string{key}); err == nil {
				t.Fatal("an acquire held back past the timeout succeeded")
			}
			p.armed.Store(false)
			p.awaitHeldBack(t, delay+10*time.Second)
			if !freeWithin(time.Second, key, r) {
				pttl, _ := r.Client().PTTL(context.Background(), key).Result()
				t.Fatalf("held back %v: the key is held by a lost acquisition nobody owns (PTTL %v)", delay, pttl)
			}
			dead := r.Client().PTTL(context.Background(), lock.DeadKey(key)).Val()
			if dead <= 0 || dead > 2*20*time.Second+lock.ReleaseGiveUpExtra {
				t.Errorf("the dead-token set's PTTL is %v, want an expiry of at most 2 × ttl + %v", dead, lock.ReleaseGiveUpExtra)
			}
			// The key is usable at once by a new attempt.
			ls, err := h.locker.Acquire(context.Background(), []string{key})
			if err != nil {
				t.Fatalf("after the lost acquisition: %v", err)
			}
			ls.Release()
		})
	}
}

// TestDeadTokensOutliveShorterUndos: the dead-token set lives as long as
// its longest-lived token: handlers with other ttls may share a key, and
// an undo of the shorter one must not cut the other's mark short.
func TestDeadTokensOutliveShorterUndos(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	ctx := context.Background()
	c := r.Client()
	key := "caddy:lock:{x}"
	keys := []string{key, lock.FenceKey(key), lock.ReplayKey(key), lock.WaitqKey(key), lock.DeadKey(key), lock.DelayKey(key)}
	for _, undo := range []struct {
		token string
		ttlMs int64
	}{{"A", 300000}, {"B", 1000}} { // ttl 5m, then 1s
		if err := lock.ReleaseScript.Run(ctx, c, keys, undo.token, "", "", 0, undo.ttlMs, "", 0, "x", 2*undo.ttlMs+lock.ReleaseGiveUpExtra.Milliseconds(), "0", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	until := c.ZScore(ctx, lock.DeadKey(key), "A").Val()
	left := time.Duration(int64(until)-c.Time(ctx).Val().UnixMilli()) * time.Millisecond
	if pttl := c.PTTL(ctx, lock.DeadKey(key)).Val(); pttl < left-time.Second {
		t.Fatalf("token A must stay dead %v more, but the set expires in %v", left.Round(time.Second), pttl.Round(time.Second))
	}
}

// TestNoOrphanOnRedlockMinority: a Redlock lease granted by a majority while
// the third server's acquire was held back: the lease's release marks the
// token dead on every server, so that acquire, reaching the third server
// after the release, takes nothing there. Before, it held the key on that
// server for the whole ttl (one more failure would then leave no majority).
func TestNoOrphanOnRedlockMinority(t *testing.T) {
	t.Parallel()
	a, b, c := startRedis(t), startRedis(t), startRedis(t)
	p := startDelayProxy(t, c.Addr, []byte(lock.AcquireScript.Hash()), 1500*time.Millisecond)
	h := provisionLock(t, fmt.Sprintf(`{"redis":[%q,%q,%q],"timeout":"300ms","wait":"0s","ttl":"20s"}`, a.Addr, b.Addr, p.addr))
	key := storedKey(h.Prefix, "/pay")
	p.warmThenArm(t, h, key, a, b, c)
	ls, err := h.locker.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatalf("two of three servers answer: %v", err)
	}
	time.Sleep(500 * time.Millisecond) // the third server's call has timed out, the lease is held
	ls.Release()
	p.armed.Store(false)
	p.awaitHeldBack(t, 12*time.Second) // the held-back acquire has reached the third server
	if !freeWithin(time.Second, key, a, b, c) {
		pttl, _ := c.Client().PTTL(context.Background(), key).Result()
		t.Fatalf("the third server holds the key for a token nobody owns (PTTL %v)", pttl)
	}
}

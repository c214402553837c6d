package redisdlm

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Tests of what a review of the lock engine found (each failed before its fix).

// TestLeaseKeepsItsQueue: the first holder of a quiet key keeps its local
// queue until it releases, so a waiter that arrives later queues behind it
// (where the hand-off and heldLocally look) instead of in a fresh queue.
func TestLeaseKeepsItsQueue(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"wait":"10s"`))
	keys := []string{storedKey(h.Prefix, "/quiet")}
	ls, err := h.locker.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *lease, 1)
	go func() {
		l2, err := h.locker.Acquire(context.Background(), keys)
		if err != nil {
			t.Errorf("waiter: %v", err)
		}
		got <- l2
	}()
	if !waitFor(5*time.Second, func() bool { return ls.QueueWaiting() == 1 }) {
		t.Fatalf("the later waiter did not queue in the holder's queue (holder's queue has %d waiters)", ls.QueueWaiting())
	}
	if !ls.HeldLocally(1) {
		t.Fatal("the holder's queue does not know the lock is held here")
	}
	ls.Release()
	select {
	case l2 := <-got:
		if l2 == nil {
			t.Fatal("waiter got no lease")
		}
		l2.Release()
	case <-time.After(10 * time.Second):
		t.Fatal("waiter not served within 10s of the release")
	}
	if n := h.locker.Queues(); n != 0 {
		t.Fatalf("%d queues left in the domain after every lease was released", n)
	}
}

// TestHandOffUsesReceiversOptions: two handlers with the same prefix and
// key but another ttl do not hand leases to each other: a waiter always
// holds a lease of its own handler's ttl.
func TestHandOffUsesReceiversOptions(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	blocker := provisionLock(t, lockCfg(r.Addr, `"ttl":"30s","timeout":"700ms"`))
	long := provisionLock(t, lockCfg(r.Addr, `"ttl":"30s","wait":"10s"`))
	short := provisionLock(t, lockCfg(r.Addr, `"ttl":"2s","wait":"10s"`))
	keys := []string{storedKey(long.Prefix, "/ttl")}
	held, err := blocker.locker.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	// Two waiters of the long handler and one of the short one queue while
	// the key is held elsewhere, so the first of them to get it reserves a
	// block of tokens for hand-offs.
	type got struct {
		ls    *lease
		pttl  time.Duration
		short bool
	}
	res := make(chan got, 3)
	acquire := func(h *RedisLock) {
		ls, err := h.locker.Acquire(context.Background(), keys)
		if err != nil {
			t.Errorf("acquire: %v", err)
			res <- got{}
			return
		}
		pttl, _ := r.Client().PTTL(context.Background(), keys[0]).Result()
		time.Sleep(20 * time.Millisecond)
		res <- got{ls, pttl, h == short}
		ls.Release()
	}
	// Each queued before the next comes (the state, not a sleep).
	queued := func(h *RedisLock, n int) {
		t.Helper()
		if !waitFor(15*time.Second, func() bool { return h.locker.WaitersFor(keys[0]) >= n }) {
			t.Fatalf("%d waiters of %s queued within 15s, want %d", h.locker.WaitersFor(keys[0]), time.Duration(h.TTL), n)
		}
	}
	go acquire(long)
	queued(long, 1)
	go acquire(long)
	queued(long, 2)
	go acquire(short)
	queued(short, 1)
	held.Release()
	for i := 0; i < 3; i++ {
		select {
		case g := <-res:
			if g.ls == nil {
				t.Fatal("a waiter got no lease")
			}
			if g.short && g.pttl > 2*time.Second {
				t.Errorf("a request of the short handler (ttl 2s) held a lease of %s in Redis", g.pttl)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("waiter not served")
		}
	}
}

// panicHook panics on the commands of one client.
type panicHook struct{}

func (panicHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (panicHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { panic("hooked command exploded") }
}
func (panicHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestQuorumFanOutRecoversPanic: a panic in one server's call of a Redlock
// fan-out is logged with its stack and counts as that server failing; the
// lock still works on the majority and the process lives on.
func TestQuorumFanOutRecoversPanic(t *testing.T) {
	t.Parallel()
	_, addrs := startRedlock(t, 3)
	h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"wait":"2s"}`, addrs))
	core, logs := observer.New(zapcore.ErrorLevel)
	h.locker.SetLogger(slogFor(zap.New(core)))
	h.locker.Servers()[1].Client().AddHook(panicHook{})
	keys := []string{storedKey(h.Prefix, "/panic")}
	for i := 0; i < 3; i++ {
		ls, err := h.locker.Acquire(context.Background(), keys)
		if err != nil {
			t.Fatalf("acquire %d with one server panicking: %v", i, err)
		}
		ls.Release()
	}
	if logs.FilterMessageSnippet("panic").Len() == 0 {
		t.Fatal("the panics were not logged")
	}
}

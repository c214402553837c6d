package lock

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestWaiterLeavesWaitqBeforeClientCloses: a waiter that gives up just as
// its client is closed (the end of a reload's grace) still takes its
// instance out of the key's Redis wait list. Before, the server reference
// was dropped before the ZREM ran: the client closed first, and the entry
// stayed at the head of the list, so other instances were refused the free
// lock until it expired.
func TestWaiterLeavesWaitqBeforeClientCloses(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	o := testOptions()
	o.BackoffMax = 5 * time.Second // a wait-list entry lives 11s, far longer than the test
	l, fcs := testLocker(t, rs, o)
	ctx := context.Background()
	key := "caddy:lock:{/waitq}"
	rc := rs[0].Client()
	rc.ZAdd(ctx, key, redisZ(time.Now().Add(time.Minute), "other-instance"))
	// The reload's grace ends just as the waiter that gave up sends its
	// ZREM: the client is to close once idle.
	s := l.servers[0]
	fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
		if cmd.Name() == "zrem" {
			s.CloseWhenIdle(func() { _ = s.conn.Client.Close() })
		}
		return next()
	})
	if _, err := l.Acquire(ctx, []string{key}); !errors.Is(err, ErrNotObtained) {
		t.Fatalf("key held elsewhere: %v, want ErrNotObtained", err)
	}
	gone := waitFor(3*time.Second, func() bool {
		return rc.ZScore(ctx, WaitqKey(key), l.InstanceID()).Err() == redis.Nil
	})
	if !gone {
		t.Fatal("this instance is still in the key's wait list after its last waiter gave up (the ZREM met a closed client)")
	}
}

// TestLeaveWaitqRecoversPanic: a panic while leaving the wait list is
// logged, never a crash of the process.
func TestLeaveWaitqRecoversPanic(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	l, fcs := testLocker(t, rs, testOptions())
	logs := &logRecorder{}
	l.SetLogger(slog.New(logs))
	key := "caddy:lock:{/waitq-panic}"
	rs[0].Client().ZAdd(context.Background(), key, redisZ(time.Now().Add(time.Minute), "other-instance"))
	fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
		if cmd.Name() == "zrem" {
			panic("zrem exploded")
		}
		return next()
	})
	if _, err := l.Acquire(context.Background(), []string{key}); !errors.Is(err, ErrNotObtained) {
		t.Fatalf("key held elsewhere: %v, want ErrNotObtained", err)
	}
	if !waitFor(3*time.Second, func() bool { return len(logs.matching("panic")) > 0 }) {
		t.Fatal("the panic while leaving the wait list was not logged")
	}
}

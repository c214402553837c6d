package lock

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestBusyFactsFromRedis: a busy answer says how long the holder has held
// the lock by Redis's clock, from its grant (an extension does not move
// it), the lease left, and the other instances in the key's wait list.
func TestBusyFactsFromRedis(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer c.Close()
	s := NewServer("busy", redisconn.NewConn(c, time.Second), func() *slog.Logger { return slog.New(slog.DiscardHandler) })
	opts := func(ttl, wait time.Duration) Options {
		return Options{TTL: ttl, Wait: wait, BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond, Permits: 1, Timeout: time.Second}
	}
	// Another ttl, another queue domain: another instance in Redis's eyes.
	holderL := New([]*Server{s}, opts(3*time.Second, 0), slog.New(slog.DiscardHandler))
	askL := New([]*Server{s}, opts(3100*time.Millisecond, 0), slog.New(slog.DiscardHandler))
	waitL := New([]*Server{s}, opts(3200*time.Millisecond, 10*time.Second), slog.New(slog.DiscardHandler))
	defer holderL.Close()
	defer askL.Close()
	defer waitL.Close()
	ctx := context.Background()
	key := "caddy:lock:{busy}"

	ls, err := holderL.Acquire(ctx, []string{key})
	if err != nil {
		t.Fatal(err)
	}
	granted := time.Now()
	time.Sleep(1200 * time.Millisecond)
	if err := holderL.Extend(ctx, ls); err != nil {
		t.Fatalf("extend: %v", err)
	}
	ask := func() *BusyError {
		t.Helper()
		_, err := askL.Acquire(ctx, []string{key})
		var b *BusyError
		if !errors.As(err, &b) {
			t.Fatalf("ask: %v, want a BusyError", err)
		}
		return b
	}
	b := ask()
	held, known := b.Held()
	if !known || held < time.Second || held > time.Since(granted)+100*time.Millisecond {
		t.Errorf("held %s (known %v) after %s and an extension, want the time since the grant", held, known, time.Since(granted))
	}
	if b.LeaseLeft() < 2*time.Second || b.LeaseLeft() > 3*time.Second {
		t.Errorf("lease left %s just after an extension of a 3s ttl", b.LeaseLeft())
	}
	if b.OthersWaiting() != 0 {
		t.Errorf("%d other instances waiting, want 0", b.OthersWaiting())
	}

	waitq := WaitqKey(key)
	waiting := func(l *Locker) bool {
		return c.ZScore(ctx, waitq, l.InstanceID()).Err() == nil
	}
	done := make(chan error, 1)
	go func() {
		ls, err := waitL.Acquire(ctx, []string{key})
		if err == nil {
			ls.Release()
		}
		done <- err
	}()
	if !waitFor(10*time.Second, func() bool { return waiting(waitL) && !waiting(askL) }) {
		t.Fatal("the waiter never stood alone in the wait list")
	}
	if b := ask(); b.OthersWaiting() != 1 {
		t.Errorf("%d other instances waiting, want 1", b.OthersWaiting())
	}
	ls.Release()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("waiter: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("waiter never got the lock")
	}
}

package lock

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// waitFor polls cond until it holds (true) or d passed (false).
var waitFor = testredis.WaitFor

// redisZ is a sorted-set member scored as a lease end in ms (the lock
// scripts' format).
func redisZ(until time.Time, member string) redis.Z {
	return redis.Z{Score: float64(until.UnixMilli()), Member: member}
}

// heldBy reports how many holders a lock key has on r.
func heldBy(r *testredis.Server, key string) int64 {
	n, _ := r.Client().ZCard(context.Background(), key).Result()
	return n
}

// logRecorder is a slog.Handler that keeps every record.
type logRecorder struct {
	mu   sync.Mutex
	recs []logRecord
}

type logRecord struct {
	level slog.Level
	msg   string
	attrs map[string]any
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logRecorder) WithGroup(string) slog.Handler            { return l }

func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	rec := logRecord{level: r.Level, msg: r.Message, attrs: map[string]any{}}
	r.Attrs(func(a slog.Attr) bool {
		rec.attrs[a.Key] = a.Value.Any()
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recs = append(l.recs, rec)
	return nil
}

// matching returns the records whose message contains s.
func (l *logRecorder) matching(s string) []logRecord {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logRecord
	for _, r := range l.recs {
		if strings.Contains(r.msg, s) {
			out = append(out, r)
		}
	}
	return out
}

// TestReleaserSurvivesPanic: a panic in the release runner, also one
// raised while it holds its lock, neither deadlocks the releaser nor
// leaves its pending releases without a runner: they still run.
func TestReleaserSurvivesPanic(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	rc := r.Client()
	c := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer c.Close()
	var arm atomic.Bool
	s := NewServer("test", redisconn.NewConn(c, time.Second), func() *slog.Logger {
		if arm.CompareAndSwap(true, false) {
			panic("logger exploded")
		}
		return slog.New(slog.DiscardHandler)
	})
	key := "caddy:lock:{panic}"
	rc.ZAdd(context.Background(), key, redisZ(time.Now().Add(time.Minute), "T"))
	// A release given up already: the runner logs that, and the log panics.
	s.rel.mu.Lock()
	s.rel.pending = map[releaseJob]*releaseState{{key: "caddy:lock:{gone}", token: "x", ttlMs: 1000}: {giveUp: time.Now().Add(-time.Second)}}
	s.rel.mu.Unlock()
	arm.Store(true)
	s.rel.retry(releaseJob{key: key, token: "T", ttlMs: 60000}, nil)
	if !waitFor(5*time.Second, func() bool { return heldBy(r, key) == 0 }) {
		t.Error("a pending release did not run after a panic in the release runner")
	}
	// pendingCount takes the releaser's lock: it never answers if the
	// lock is still held.
	drained := make(chan bool, 1)
	go func() { drained <- waitFor(5*time.Second, func() bool { return s.rel.pendingCount() == 0 }) }()
	select {
	case ok := <-drained:
		if !ok {
			t.Errorf("%d releases still pending", s.rel.pendingCount())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the releaser is deadlocked: its lock is still held after the panic")
	}
}

// TestWakeListenerRestartsAfterPanic: a listener whose dispatch panics logs
// the panic with its stack, subscribes again by itself and keeps waking.
func TestWakeListenerRestartsAfterPanic(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	rc := r.Client()
	logs := &logRecorder{}
	c := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer c.Close()
	wl := newWakeListener(c, func() *slog.Logger { return slog.New(logs) })
	defer wl.stop()
	got := make(chan string, 10)
	wl.dispatch = func(p string) {
		switch p {
		case "": // the subscription (re)began
		case "boom":
			panic("dispatch exploded")
		default:
			got <- p
		}
	}
	if !wl.ensure(context.Background(), 5*time.Second) {
		t.Fatal("listener did not subscribe")
	}
	rc.Publish(context.Background(), WakeChannel, "boom")
	if !waitFor(5*time.Second, func() bool { return len(logs.matching("panic")) == 1 }) {
		t.Fatal("the panic was not logged")
	}
	e := logs.matching("panic")[0]
	if !strings.Contains(fmt.Sprint(e.attrs["stack"]), "wake") {
		t.Errorf("panic log has no stack: %v", e.attrs)
	}
	// It comes back by itself and delivers again.
	deadline := time.Now().Add(10 * time.Second)
	for {
		rc.Publish(context.Background(), WakeChannel, "after")
		select {
		case p := <-got:
			if p != "after" {
				t.Fatalf("got %q", p)
			}
			return
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("listener did not deliver again within 10s of a panic")
		}
	}
}

package lock

// Wake-ups across instances: one Pub/Sub subscription per Redis server and
// process, on one channel, whatever the number of keys; a release announces
// itself there and every other domain wakes its local queue of that key.

import (
	"context"
	"errors"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// dispatchWake delivers a release announced on Redis to the local queues of
// that key in every domain but the one that announced it (which woke its own
// queue already). Two domains in one process share a Redis server when they
// use different client settings or lease options for it.
//
// An empty payload wakes every local queue's head: the subscription (re)began
// and announcements may have been missed meanwhile.
func dispatchWake(payload string) {
	if payload == "" {
		for _, d := range otherDomains("") {
			d.wakeAll()
		}
		return
	}
	from, id, ok := strings.Cut(payload, " ")
	if !ok {
		return
	}
	for _, d := range otherDomains(from) {
		d.wake([]string{id})
	}
}

// wakeListener holds the one Pub/Sub subscription of one Redis client. It
// starts on the first contended wait, reconnects by itself, survives a
// panic (logged with its stack, then it starts again), and stops with the
// server.
type wakeListener struct {
	client   subscriber
	logger   func() *slog.Logger
	dispatch func(payload string) // dispatchWake; tests replace it

	mu      sync.Mutex
	started bool
	active  bool          // subscription confirmed
	ready   chan struct{} // closed when active
	cancel  context.CancelFunc
	done    chan struct{}
	ps      *redis.PubSub
}

// subscriber is the part of a Redis client the listener uses.
type subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

func newWakeListener(c subscriber, logger func() *slog.Logger) *wakeListener {
	return &wakeListener{client: c, logger: logger, dispatch: dispatchWake, ready: make(chan struct{})}
}

// ensure starts the listener on first use and waits (up to timeout) for
// its subscription. It returns true when the subscription became active
// during the call, so the caller should try once more (a release between
// its failed attempt and the subscription would otherwise go unnoticed).
func (wl *wakeListener) ensure(ctx context.Context, timeout time.Duration) bool {
	wl.mu.Lock()
	if wl.active {
		wl.mu.Unlock()
		return false
	}
	if wl.started {
		// Reconnecting after a fault: don't hold the waiter up; its backoff
		// poll covers the gap, and the next contended wait re-checks.
		wl.mu.Unlock()
		return false
	}
	wl.started = true
	lctx, cancel := context.WithCancel(context.Background())
	wl.cancel = cancel
	wl.done = make(chan struct{})
	go wl.supervise(lctx)
	ready := wl.ready
	wl.mu.Unlock()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-ready:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

func (wl *wakeListener) setActive(on bool) {
	wl.mu.Lock()
	defer wl.mu.Unlock()
	if on && !wl.active {
		wl.active = true
		close(wl.ready)
	} else if !on && wl.active {
		wl.active = false
		wl.ready = make(chan struct{})
	}
}

// supervise runs the listener until ctx ends, starting it again after a
// panic: waiters poll meanwhile, so nothing but latency is lost.
func (wl *wakeListener) supervise(ctx context.Context) {
	defer close(wl.done)
	for ctx.Err() == nil {
		if !wl.run(ctx) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// run listens until ctx ends (false) or a panic (true: run again).
func (wl *wakeListener) run(ctx context.Context) (panicked bool) {
	ps := wl.client.Subscribe(ctx, WakeChannel)
	defer ps.Close()
	defer func() {
		if r := recover(); r != nil {
			wl.setActive(false)
			panicked = true
			if lg := wl.logger(); lg != nil {
				lg.Error("panic in the redis_lock wake-up listener; restarting it", slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
			}
		}
	}()
	wl.mu.Lock()
	wl.ps = ps
	wl.mu.Unlock()
	fails := 0
	for ctx.Err() == nil {
		msg, err := ps.ReceiveTimeout(ctx, 30*time.Second)
		if err != nil {
			if ctx.Err() != nil {
				return false
			}
			var ne interface{ Timeout() bool }
			if errors.As(err, &ne) && ne.Timeout() {
				// Quiet channel: check the connection is alive.
				if perr := ps.Ping(ctx); perr == nil {
					continue
				}
			}
			wl.setActive(false)
			fails++
			d := time.Duration(fails) * 100 * time.Millisecond
			if d > time.Second {
				d = time.Second
			}
			select {
			case <-ctx.Done():
				return false
			case <-time.After(d):
			}
			continue
		}
		fails = 0
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				wl.setActive(true)
				// A release announced while this listener was not yet (or
				// no longer) subscribed was missed: every local head asks
				// once more, instead of sleeping through its backoff.
				wl.dispatch("")
			}
		case *redis.Message:
			wl.dispatch(m.Payload)
		}
	}
	return false
}

func (wl *wakeListener) stop() {
	wl.mu.Lock()
	cancel, done, ps := wl.cancel, wl.done, wl.ps
	wl.mu.Unlock()
	if cancel != nil {
		cancel()
		if ps != nil {
			_ = ps.Close() // interrupts a blocked read
		}
		<-done
	}
}

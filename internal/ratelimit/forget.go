package ratelimit

import (
	"context"
	"errors"
	"log/slog"
	"runtime/debug"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Admin resets (a key's quota, its ban) reach every instance's deny caches
// through Redis Pub/Sub: the instance that resets publishes the limit's
// prefix and id on ForgetChannel; every instance listening forgets the id in
// the deny caches of that prefix at once. A listener that lost its
// subscription (a connection lost, Redis restarted) may have missed a reset:
// each subscription after its first forgets everything instead. (The first
// follows the first rate-limit call by a round trip; a reset published just
// then, of a key rejected just then, is the only one a listener may miss.)

// ForgetChannel is the Pub/Sub channel of admin resets.
const ForgetChannel = "redisdlm:rl:forget"

// Publisher is what PublishForget needs of a Redis client.
type Publisher interface {
	Publish(ctx context.Context, channel string, message any) *redis.IntCmd
}

// Subscriber is what a ForgetListener needs of a Redis client.
type Subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// PublishForget tells every listening instance to forget id of the limits
// under prefix.
func PublishForget(ctx context.Context, c Publisher, prefix, id string) error {
	return c.Publish(ctx, ForgetChannel, prefix+"\x00"+id).Err()
}

// Forgetter is told what to forget: one id of the limits under prefix, or
// (all) everything, after a reset may have been missed.
type Forgetter interface {
	Forget(prefix, id string)
	ForgetAll()
}

// ForgetListener receives the resets published on one Redis.
type ForgetListener struct {
	client     Subscriber
	forgetter  Forgetter
	logger     func() *slog.Logger
	cancel     context.CancelFunc
	done       chan struct{}
	subscribed bool // once: later subscriptions forget everything
}

// ListenForget starts listening on c until Close; f is told of each reset.
// logger returns the logger of the moment, for a panic.
func ListenForget(c Subscriber, f Forgetter, logger func() *slog.Logger) *ForgetListener {
	ctx, cancel := context.WithCancel(context.Background())
	l := &ForgetListener{client: c, forgetter: f, logger: logger, cancel: cancel, done: make(chan struct{})}
	go l.supervise(ctx)
	return l
}

// Close stops the listener and waits for it.
func (l *ForgetListener) Close() {
	l.cancel()
	<-l.done
}

// supervise runs the listener until ctx ends, starting it again after a
// panic.
func (l *ForgetListener) supervise(ctx context.Context) {
	defer close(l.done)
	for ctx.Err() == nil {
		if !l.listen(ctx) {
			return
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return
		}
	}
}

// listen receives resets until ctx ends (false) or a panic (true).
func (l *ForgetListener) listen(ctx context.Context) (panicked bool) {
	ps := l.client.Subscribe(ctx, ForgetChannel)
	defer ps.Close()
	defer func() {
		if r := recover(); r != nil {
			panicked = true
			l.logger().Error("panic in the redis_ratelimit reset listener; restarting it", slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
		}
	}()
	go func() { <-ctx.Done(); _ = ps.Close() }() // interrupts a blocked read
	fails := 0
	for ctx.Err() == nil {
		msg, err := ps.ReceiveTimeout(ctx, 30*time.Second)
		if err != nil {
			fails = retryReceive(ctx, ps, err, fails)
			continue
		}
		fails = 0
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" && l.subscribed {
				l.forgetter.ForgetAll() // resets published meanwhile were missed
			}
			l.subscribed = true
		case *redis.Message:
			if prefix, id, ok := strings.Cut(m.Payload, "\x00"); ok {
				l.forgetter.Forget(prefix, id)
			}
		}
	}
	return false
}

// retryReceive handles a failed receive: a quiet channel is pinged, any
// other failure waits a little longer each time (at most a second); it
// returns the failures in a row.
func retryReceive(ctx context.Context, ps *redis.PubSub, err error, fails int) int {
	var ne interface{ Timeout() bool }
	if errors.As(err, &ne) && ne.Timeout() && ps.Ping(ctx) == nil {
		return 0
	}
	fails++
	sleepCtx(ctx, min(time.Duration(fails)*100*time.Millisecond, time.Second))
	return fails
}

// sleepCtx waits d, or until ctx ends (false).
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

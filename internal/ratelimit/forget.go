package ratelimit

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

// Admin resets (a key's quota, its ban) and bans reach every instance's
// deny caches through Redis Pub/Sub. The instance that resets publishes the
// limit's prefix and id on ForgetChannel; every instance listening forgets
// the id in the deny caches of that prefix at once. The instance whose
// decision starts a ban publishes it on the same channel (PublishBan: the
// prefix, the id, when the ban ends); every instance holds it in the deny
// caches of that prefix until it ends, so a ban holds on every instance
// through an outage.
//
// A listener that lost its subscription (a connection lost, Redis
// restarted) may have missed a reset: each subscription after its first
// forgets everything but the bans (Forgetter.Resubscribed). Whether the
// Redis process is the one of the previous subscription tells what to do
// with them: the same process may have lifted one meanwhile, so each is
// checked with Redis on its key's next request; a new process (a restart,
// possibly empty, or a failover) may have lost them, so they are written
// back (WriteBackBans). (The first subscription follows the first
// rate-limit call by a round trip; a reset published just then, of a key
// rejected just then, is the only one a listener may miss.)

// publishForget tells every listening instance to forget id of the limits
// under prefix.
func publishForget(ctx context.Context, c Publisher, prefix, id string) error {
	return c.Publish(ctx, ForgetChannel, prefix+"\x00"+id).Err()
}

// banTag starts a ban's message. A prefix never holds a brace, so no reset
// message starts with it (and a listener that does not know bans reads it
// as a reset of a prefix that no handler has).
const banTag = "{ban}\x00"

// publishBan tells every listening instance that id of the limits under
// prefix is banned: the ban ends in left, and a request may pass in retry
// (later than left when the quota that started the ban admits only then).
func publishBan(ctx context.Context, c Publisher, prefix, id string, left, retry time.Duration) error {
	msg := banTag + prefix + "\x00" + strconv.FormatInt(left.Milliseconds(), 10) + "\x00" +
		strconv.FormatInt(retry.Milliseconds(), 10) + "\x00" + id
	return c.Publish(ctx, ForgetChannel, msg).Err()
}

// parseBan reads a ban's message (PublishBan); ok is false for anything
// else, or a ban message that does not parse.
func parseBan(payload string) (prefix, id string, left, retry time.Duration, ok bool) {
	rest, isBan := strings.CutPrefix(payload, banTag)
	if !isBan {
		return "", "", 0, 0, false
	}
	f := strings.SplitN(rest, "\x00", 4)
	if len(f) != 4 {
		return "", "", 0, 0, false
	}
	l, err1 := strconv.ParseInt(f[1], 10, 64)
	r, err2 := strconv.ParseInt(f[2], 10, 64)
	if err1 != nil || err2 != nil || l <= 0 || r < 0 || l > maxBanMs || r > maxBanMs {
		return "", "", 0, 0, false
	}
	return f[0], f[3], time.Duration(l) * time.Millisecond, time.Duration(r) * time.Millisecond, true
}

// maxBanMs bounds the moments of a ban's message (about 292 years: what a
// time.Duration holds).
const maxBanMs = int64(time.Duration(1<<63-1) / time.Millisecond)

// ForgetListener receives the resets published on one Redis.
type ForgetListener struct {
	client     Subscriber
	forgetter  Forgetter
	restarts   func() uint64
	logger     func() *slog.Logger
	cancel     context.CancelFunc
	done       chan struct{}
	subscribed bool   // once: later subscriptions forget everything but bans
	seen       uint64 // restarts() at the last subscription
}

// ListenForget starts listening on c until Close; f is told of each reset
// and ban. restarts counts the Redis processes c found replaced (it must be
// raised before a new connection's first command, as
// redisconn.Check.Restarts is: go-redis runs the connection hook on a
// Pub/Sub connection too, before it subscribes). logger returns the logger
// of the moment, for a panic.
func listenForget(c Subscriber, f Forgetter, restarts func() uint64, logger func() *slog.Logger) *ForgetListener {
	ctx, cancel := context.WithCancel(context.Background())
	l := &ForgetListener{client: c, forgetter: f, restarts: restarts, logger: logger, cancel: cancel, done: make(chan struct{})}
	go l.supervise(ctx)
	return l
}

// stop stops the listener and waits for it (ForgetListener.Close).
func (l *ForgetListener) stop() {
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
			l.onSubscription(m.Kind)
		case *redis.Message:
			l.deliver(m.Payload)
		}
	}
	return false
}

// onSubscription handles a subscription's confirmation: after the first,
// resets published meanwhile were missed, and bans may have been lifted
// (the same Redis process) or lost (a new one).
func (l *ForgetListener) onSubscription(kind string) {
	if kind != "subscribe" {
		return
	}
	n := l.restarts()
	if l.subscribed {
		l.forgetter.Resubscribed(n != l.seen)
	}
	l.subscribed, l.seen = true, n
}

// deliver passes one message on: a ban, or a reset.
func (l *ForgetListener) deliver(payload string) {
	if prefix, id, left, retry, ok := parseBan(payload); ok {
		l.forgetter.Ban(prefix, id, left, retry)
	} else if prefix, id, ok := strings.Cut(payload, "\x00"); ok && !strings.HasPrefix(payload, banTag) {
		l.forgetter.Forget(prefix, id)
	}
}

var (
	//go:embed scripts/ratelimit_ban_write_back.lua
	writeBackLua    string
	writeBackScript = redisconn.NewScript(writeBackLua)
)

// writeBackBans writes the bans an instance holds back to a Redis that may
// have lost them (a new process), in one pipeline: each ban key that is
// missing is set with the ban's remaining lifetime; one that is there (the
// ban was started again, or another instance wrote it back) is left as it
// is. It returns how many it set.
func writeBackBans(ctx context.Context, c Pipeliner, bans []KeptBan) (int, error) {
	if len(bans) == 0 {
		return 0, nil
	}
	pipe := c.Pipeline()
	cmds := make([]*redis.Cmd, 0, len(bans))
	for _, b := range bans {
		cmds = append(cmds, writeBackScript.Eval(ctx, pipe, []string{b.Key}, max(b.Left.Milliseconds(), 1), max(b.Retry, b.Left).Microseconds()))
	}
	_, err := pipe.Exec(ctx)
	set := 0
	for _, cmd := range cmds {
		if n, e := cmd.Int(); e == nil && n == 1 {
			set++
		}
	}
	if err != nil {
		return set, fmt.Errorf("writing back bans: %w", err)
	}
	return set, nil
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

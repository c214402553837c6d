package lock

// The servers of a lock and the fan-out to them: a server's client and its
// wake-up listener; one call to every server in parallel, decided as soon
// as a majority answered either way.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/throttle"
	"github.com/redis/go-redis/v9"
)

// Server is one Redis server, or one Cluster or Sentinel group, as the
// engine sees it: a stable id (identical connection settings give the same
// id), the shared client (whose users keep it open, see redisconn.Conn),
// the server's Pub/Sub wake-up listener, and the releases it still owes
// (retried in the background).
type Server struct {
	id      string
	name    string // for log lines: the address (never a password)
	conn    *redisconn.Conn
	client  redis.UniversalClient // conn's
	timeout time.Duration         // bound of one call: conn's
	wake    *wakeListener
	rel     releaser
	logger  func() *slog.Logger
	// onReleaseFailure, if set, counts a failed release of a lease that
	// was held, or whose acquire outcome is unknown.
	onReleaseFailure func(handler string)
}

// NewServer wraps a shared client; nothing is dialed until the first call.
// logger returns the logger of the moment (the server outlives configs).
func NewServer(id string, conn *redisconn.Conn, logger func() *slog.Logger) *Server {
	c := conn.Client
	s := &Server{id: id, name: redisconn.ClientName(c), conn: conn, client: c, timeout: conn.Timeout, wake: newWakeListener(c, logger), logger: logger}
	s.rel.s = s
	s.rel.warn = throttle.New(10 * time.Second)
	return s
}

// closeWhenIdle stops the wake-up listener and runs closeClient once no
// user of the client is left (at once when none is).
func (s *Server) closeWhenIdle(closeClient func()) {
	s.conn.CloseWhenIdle(func() { s.wake.stop(); closeClient() })
}

// tally counts granted (script returned 1), busy (0) and failed calls.
func tally(res []result) (granted, busy, errs int) {
	for _, r := range res {
		switch {
		case !r.done:
		case r.err != nil:
			errs++
		case r.v.([]int64)[0] == 1:
			granted++
		default:
			busy++
		}
	}
	return
}

// unknownOutcome reports whether a call that failed with err may still run
// (or have run) on the server: a timeout, a lost connection, a call never
// sent. An error that Redis answered (out of memory, a script error, BUSY)
// is a known outcome: the call will not run later.
func unknownOutcome(err error) bool {
	var re redis.Error
	return err != nil && !errors.As(err, &re)
}

// refusedUnrun reports whether Redis refused a call without running it
// (over maxmemory, a read-only replica, busy or loading, no permission,
// ...): it took nothing. An error raised while a script ran names the
// script, and may come after some of its writes.
func refusedUnrun(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	if strings.Contains(msg, "user_script") {
		return false
	}
	for _, p := range []string{"OOM ", "READONLY ", "NOSCRIPT ", "BUSY ", "LOADING ", "MASTERDOWN ", "MISCONF ", "NOREPLICAS ", "CLUSTERDOWN ", "TRYAGAIN ", "NOPERM "} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// anyUnknown reports whether any answered call of res has an unknown outcome.
func anyUnknown(res []result) bool {
	for _, r := range res {
		if r.done && unknownOutcome(r.err) {
			return true
		}
	}
	return false
}

// majorityAnswered ends a fan-out once a majority answered without error.
func (l *Locker) majorityAnswered(res []result, _ int) bool {
	ok := 0
	for _, r := range res {
		if r.done && r.err == nil {
			ok++
		}
	}
	return ok >= l.quorum
}

// result is one server's answer in a fan-out.
type result struct {
	v    any
	err  error
	done bool
}

// callAll runs f on every server in parallel and returns the results in
// Server order; decide is called after each result and may end the wait
// early (a majority decided) by returning true. Results that arrive after
// that go to late (if not nil) instead, so the caller can undo them. When
// ctx ends first, callAll returns what it has (the rest go to late).
//
// A panic in f becomes that server's error (logged with its stack), never
// a crash of the process.
func (l *Locker) callAll(ctx context.Context, f func(ctx context.Context, i int, s *Server) (any, error), decide func(res []result, n int) bool, late func(i int, r result)) []result {
	res := make([]result, len(l.servers))
	safe := func(i int) (v any, err error) {
		defer func() {
			if r := recover(); r != nil {
				l.logPanic("calling redis", r)
				v, err = nil, fmt.Errorf("redisdlm: panic calling redis: %v", r)
			}
		}()
		return f(ctx, i, l.servers[i])
	}
	if len(l.servers) == 1 {
		v, err := safe(0)
		res[0] = result{v: v, err: err, done: true}
		return res
	}
	var mu sync.Mutex
	closed := false
	arrived := make(chan struct{}, len(l.servers))
	for i := range l.servers {
		go func(i int) {
			v, err := safe(i)
			r := result{v: v, err: err, done: true}
			mu.Lock()
			if closed {
				mu.Unlock()
				if late != nil {
					defer l.recoverPanic("handling a late redis answer")
					late(i, r)
				}
				return
			}
			res[i] = r
			mu.Unlock()
			arrived <- struct{}{}
		}(i)
	}
	finish := func() []result {
		closed = true
		out := append([]result(nil), res...)
		mu.Unlock()
		return out
	}
	for n := 1; n <= len(l.servers); n++ {
		select {
		case <-arrived:
		case <-ctx.Done():
			mu.Lock()
			return finish()
		}
		mu.Lock()
		if (decide != nil && decide(res, n)) || n == len(l.servers) {
			return finish()
		}
		mu.Unlock()
	}
	return res
}

// recoverPanic, deferred in a background goroutine, logs a panic with its
// stack and lets the process go on.
func (l *Locker) recoverPanic(what string) {
	if r := recover(); r != nil {
		l.logPanic(what, r)
	}
}

func (l *Locker) logPanic(what string, r any) {
	if l.logger != nil {
		l.logger.Error("panic in the lock engine; recovered", slog.String("while", what), slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
	}
}

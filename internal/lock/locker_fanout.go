package lock

// A Locker's fan-out: one call to every server in parallel, decided as
// soon as a majority answered either way, and how its answers count.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

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
	if len(l.servers) == 1 {
		v, err := l.safeCall(ctx, f, 0)
		res[0] = result{v: v, err: err, done: true}
		return res
	}
	var mu sync.Mutex
	closed := false
	arrived := make(chan struct{}, len(l.servers))
	for i := range l.servers {
		go func(i int) {
			v, err := l.safeCall(ctx, f, i)
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

// safeCall is f on server i, a panic in it that server's error.
func (l *Locker) safeCall(ctx context.Context, f func(ctx context.Context, i int, s *Server) (any, error), i int) (v any, err error) {
	defer func() {
		if r := recover(); r != nil {
			l.logPanic("calling redis", r)
			v, err = nil, fmt.Errorf("redisdlm: panic calling redis: %v", r)
		}
	}()
	return f(ctx, i, l.servers[i])
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
	if err == nil {
		return false
	}
	var re redis.Error
	return !errors.As(err, &re)
}

// refusedUnrun reports whether Redis refused a call without running it
// (over maxmemory, a read-only replica, busy or loading, no permission,
// ...): it took nothing. An error raised while a script ran names the
// script, and may come after some of its writes.
func refusedUnrun(err error) bool {
	if err == nil {
		return false
	}
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	if strings.Contains(msg, "user_script") {
		return false
	}
	return redisconn.RefusedForNow(msg) || strings.HasPrefix(msg, "NOSCRIPT ") || strings.HasPrefix(msg, "NOPERM ")
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

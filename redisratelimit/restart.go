package redisratelimit

// fail_local when Redis restarts empty (a new run_id, seen by the
// connection layer: redisconn.Check.Restarts): Redis has lost the windows,
// and each instance knows only its own part of them. So an instance that
// sees a restart decides locally for a heartbeat's life (every instance
// sees the restart within it: each tries a heartbeat every second) while
// it charges every admission of the current windows it counts (those Redis
// decided through it, and its own) again, in one batch per key; then it
// goes back to Redis, which holds the fleet's windows again, so the
// restart adds nothing. An answer that came from the new process before
// the restart was known is not used: its request is decided locally too.

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"go.uber.org/zap"
)

// errRestartHold is the answer of a decision while this instance decides
// locally after Redis restarted (or whose answer came from the restarted
// Redis before that was known).
var errRestartHold = errors.New("redis_ratelimit: redis restarted: deciding locally while this instance charges its admissions of the current windows again")

// restartWatch is what a localState knows of the restarts the Redis
// clients of its handlers have seen.
type restartWatch struct {
	mu   sync.Mutex
	seen map[*redisconn.Check]*checkSeen
	// Until when (UnixNano) decisions stay local after a restart.
	hold atomic.Int64
	// When a restart was last seen (UnixNano; 0: never): N read from the
	// heartbeat set, which the restart emptied, is not lowered for a
	// heartbeat's life after it.
	at atomic.Int64
}

// checkSeen is the count of restarts of one client's check that a state
// has answered, and the handlers on that client.
type checkSeen struct {
	count atomic.Uint64
	users int // under restartWatch.mu
}

// watch registers a handler on client check c; the restarts c has counted
// so far are taken as known (the handler was made after them).
func (w *restartWatch) watch(c *redisconn.Check) *checkSeen {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seen == nil {
		w.seen = make(map[*redisconn.Check]*checkSeen)
	}
	s := w.seen[c]
	if s == nil {
		s = new(checkSeen)
		s.count.Store(c.Restarts())
		w.seen[c] = s
	}
	s.users++
	return s
}

// unwatch undoes watch.
func (w *restartWatch) unwatch(c *redisconn.Check) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.seen[c]; s != nil {
		if s.users--; s.users <= 0 {
			delete(w.seen, c)
		}
	}
}

// holding reports whether decisions stay local at now after a restart.
func (w *restartWatch) holding(now time.Time) bool { return now.UnixNano() < w.hold.Load() }

// recent reports whether a restart was seen within a heartbeat's life of now.
func (w *restartWatch) recent(now time.Time) bool {
	at := w.at.Load()
	return at != 0 && now.Sub(time.Unix(0, at)) < ratelimit.HeartbeatLife
}

// restarts is the count of restarts the handler's client has seen: read
// before a call, and given to redisRestarted with its answer (0 without
// fail_local).
func (h *RedisRateLimit) restarts() uint64 {
	if h.local == nil {
		return 0
	}
	return h.client.Check.Restarts()
}

// redisRestarted reports whether the answer of a call made when the
// client had seen before restarts may come from a restarted Redis: the
// count rose during the call (the connection hook raises it before a new
// connection's first command), or a restart is known that no call had
// answered yet. The first to see a restart starts the hold and the charge
// of the current windows. (A call answered during the hold, sent before it
// began, may come from the new process as well: see holding.)
func (h *RedisRateLimit) redisRestarted(before uint64, now time.Time, log *zap.Logger) bool {
	after := h.client.Check.Restarts()
	seen := h.seen.count.Load()
	if after == before && after == seen {
		return false
	}
	first := after > seen && h.seen.count.CompareAndSwap(seen, after)
	if first {
		h.restartHold(now, log)
	}
	return after != before || first
}

// fromRestarted reports whether a decision's answer, of a call made when
// the client had seen before restarts, may come from a restarted Redis
// before this instance had charged its windows there: not to be used.
func (h *RedisRateLimit) fromRestarted(before uint64) bool {
	now := time.Now()
	return h.redisRestarted(before, now, h.logger) || h.local.restart.holding(now)
}

// restartHold starts deciding locally for a heartbeat's life and makes
// every admission of the current windows a charge again.
func (h *RedisRateLimit) restartHold(now time.Time, log *zap.Logger) {
	h.local.restart.at.Store(now.UnixNano())
	h.local.restart.hold.Store(now.Add(ratelimit.HeartbeatLife).UnixNano())
	h.local.returnAt(now.Add(ratelimit.HeartbeatLife)) // the hold's end is a return
	h.local.lim.Recharge(now)
	log.Warn("redis restarted (a new process, its windows lost): deciding locally (fail_local) while this instance charges its admissions of the current windows again",
		zap.String("redis", h.client.Settings.Display()), zap.Duration("for", ratelimit.HeartbeatLife))
	select {
	case h.fleet.wake <- struct{}{}:
	default:
	}
}

package redisratelimit

// The instances that share a rate-limit prefix, through Redis. A fail_local
// handler runs one loop (fleetLoop) that, every fleetTick:
//   - records this instance's heartbeat every ratelimit.HeartbeatEvery and
//     reads how many instances keep one (N);
//   - charges Redis with what it admitted locally while Redis was
//     unreachable, once Redis answers (local.go); in local mode it
//     tries every localTick.
// A handler without fail_local runs no loop. (Admin resets reach the other
// instances through Pub/Sub: forget.go.)

import (
	"context"
	_ "embed"
	"errors"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/google/uuid"
	"go.uber.org/zap"
)

// instanceID names this process in the heartbeats: one id per process, so
// a config reload (new handlers, same process) adds no instance.
var instanceID = uuid.NewString()

// instancePerClient makes the instance id one per Redis client instead of
// per process, so that tests can run two "instances" in one process (two
// sites with their own clients). Set only by TestMain.
var instancePerClient bool

const (
	fleetTick = 500 * time.Millisecond
	localTick = 100 * time.Millisecond // fail_local, while Redis is not known to answer
)

// fleet is a fail_local handler's loop state (what it learns of the other
// instances is in its localState, which outlives a reload).
type fleet struct {
	// The handler's logger as Provision left it: the loop reads no field a
	// later change of the handler could race with.
	logger *zap.Logger
	member string // this instance's heartbeat id
	// Woken when Redis answered a decision while local admissions wait to
	// be charged.
	wake  chan struct{}
	beats *ratelimit.Fleet // this instance's heartbeat, on a connection of its own
	// failing: the last heartbeat got no answer (Redis unreachable).
	failing atomic.Bool
}

// instance is this instance's heartbeat id.
func (h *RedisRateLimit) instance() string {
	if instancePerClient {
		return instanceID + "/" + shared.KeyHash(h.clientKey)
	}
	return instanceID
}

// startFleet starts the handler's fleet loop, stopped with ctx (the
// config's). Its first call comes a tick later, so `caddy validate`
// (Provision then Cleanup) calls no Redis.
func (h *RedisRateLimit) startFleet(ctx context.Context) {
	if h.local == nil {
		return
	}
	h.fleet = &fleet{wake: make(chan struct{}, 1), logger: h.logger, member: h.instance()}
	h.fleet.beats = ratelimit.NewFleet(h.client.Redis, h.Prefix, h.fleet.member)
	go h.fleetLoop(ctx)
}

func (h *RedisRateLimit) fleetLoop(ctx context.Context) {
	defer func() {
		if v := recover(); v != nil {
			h.fleet.logger.Error("rate-limit fleet loop panicked; heartbeats and charges of local admissions stop for this handler",
				zap.Any("panic", v), zap.ByteString("stack", debug.Stack()))
		}
	}()
	t := time.NewTimer(fleetTick)
	defer t.Stop()
	defer h.fleet.beats.Close()
	var lastBeat time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-h.fleet.wake:
		}
		local := h.local.mode.Load()
		// In local mode the heartbeat is tried every localTick: its answer
		// tells that Redis answers again, and the local admissions are
		// charged at once (another instance may decide by Redis already).
		if local {
			t.Reset(localTick)
		} else {
			t.Reset(fleetTick)
		}
		now := time.Now()
		ok := false
		// Not counted yet: a beat every tick, so joining ends soon after
		// the others counted this instance (awaitCounted waits for it).
		counted := h.local.instances.Load() > 0 && h.local.joining.Load() == 0
		if now.Sub(lastBeat) >= ratelimit.HeartbeatEvery-fleetTick/2 || local || !counted {
			if ok = h.heartbeat(ctx); ok {
				lastBeat = now
			}
		}
		// Redis answers again: charge it with what was admitted locally.
		if (ok || !h.local.mode.Load()) && h.local.lim.Pending() {
			h.chargeLocal(ctx)
		}
	}
}

// heartbeat records this instance's heartbeat and reads the count of
// instances. It reports whether Redis answered.
func (h *RedisRateLimit) heartbeat(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	restarts := h.restarts()
	b, err := h.fleet.beats.Beat(ctx, h.local.joining.Load())
	now := time.Now()
	restarted := err == nil && h.redisRestarted(restarts, now, h.fleet.logger)
	h.fleet.failing.Store(err != nil)
	if h.local.unanswered.Swap(err != nil) && err == nil && h.local.mode.Load() {
		h.local.returnAt(now) // Redis answers again: the return begins
	}
	if err != nil {
		if c := h.fleet.logger.Check(zap.DebugLevel, "rate-limit heartbeat failed"); c != nil {
			c.Write(zap.Error(err))
		}
		return false
	}
	h.noteFleet(b, restarted || h.local.restart.recent(now))
	return true
}

// noteFleet takes what a heartbeat read: Redis's time then (µs), the count
// of instances, whether this beat added the instance to the set, and how
// many others have not beaten since the beat that joined (h.local.joining).
//
// N is the count, except after a restart of Redis: the set fills again as
// every instance beats, so a lower count is not taken for a heartbeat's
// life (afterRestart).
//
// An instance new in the set (just started, or away for a heartbeat's
// life) is joining while the others have not read a count with it in it:
// each of them reads one with its next heartbeat, up to a second later,
// and until then takes a share too big by this instance's. So while it is
// joining the instance admits nothing, through Redis or locally: its
// requests wait until it is counted (awaitCounted), and an outage that
// begins meanwhile finds it with no share (serveLocal answers as
// fail_closed). After a restart every instance is added again, but the
// others' N still counts it: it joins again only when it was joining
// before.
func (h *RedisRateLimit) noteFleet(b ratelimit.Beat, afterRestart bool) {
	at, n := b.At, b.Instances
	if n > 0 && (!afterRestart || n > h.local.instances.Load()) {
		h.local.instances.Store(n)
	}
	joining := h.local.joining.Load()
	switch {
	case afterRestart && joining != 0:
		h.local.joining.Store(at) // counted again from a beat on the new process
	case joining == 0 && b.Added && !afterRestart && b.Behind > 0:
		h.local.joining.Store(at)
		h.fleet.logger.Info("joining the instances sharing the limit: no local decisions (fail_local) until each of them has counted this one",
			zap.Int64("instances", n))
	case joining != 0 && b.Behind == 0:
		h.local.joining.Store(0)
	}
}

// joinWait bounds how long a request waits for its instance to be counted
// by the others (awaitCounted): each of them reads a count with its next
// heartbeat, a second apart, and one that stopped leaves the set after a
// heartbeat's life.
const joinWait = ratelimit.HeartbeatLife + fleetTick

// errNotCounted: the others have not counted this instance within
// joinWait (Redis unreachable, or an instance that stopped beating): it
// admits nothing, and serveLocal answers as fail_closed.
var errNotCounted = errors.New("redis_ratelimit: this instance is not yet counted by the others sharing the limit (fail_local)")

// awaitCounted holds a request of a fail_local handler (with N from the
// heartbeats) until its instance is counted: it has a count, and every
// other instance has read one with it in it. Until then an admission here,
// even Redis's, could go beyond the bound when an outage begins, since
// the others' shares do not leave room for this instance's. It happens
// once per process (a reload keeps the instance and its state), for about
// a second, the loop's first heartbeat being made at once.
func (h *RedisRateLimit) awaitCounted(ctx context.Context) error {
	counted := func() bool { return h.local.instances.Load() > 0 && h.local.joining.Load() == 0 }
	if h.Instances > 0 || counted() {
		return nil
	}
	select {
	case h.fleet.wake <- struct{}{}: // the first heartbeat at once
	default:
	}
	t := time.NewTimer(joinWait)
	defer t.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !counted() {
		if h.fleet.failing.Load() || h.local.mode.Load() {
			return errNotCounted // Redis does not answer: no count to wait for
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			return errNotCounted
		case <-tick.C:
		}
	}
	return nil
}

package redisdlm

// The instances that share a rate-limit prefix, through Redis. Each
// handler runs one loop (fleetLoop) that, every fleetTick:
//   - while its deny cache may hold a rejection, reads the limit ids the
//     admin API reset under its prefix since its last look, and forgets them
//     in its deny cache: a reset reaches every instance within about a
//     second;
//   - with fail_local, records this instance's heartbeat every
//     heartbeatEvery and reads how many instances keep one (N);
//   - with fail_local, charges Redis with what it admitted locally while
//     Redis was unreachable, once Redis answers (ratelimit_local.go); in
//     local mode it tries every localTick.
// An idle handler without fail_local calls nothing.

import (
	"context"
	_ "embed"
	"fmt"
	"runtime/debug"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

var (
	//go:embed scripts/ratelimit_fleet.lua
	rateLimitFleetLua    string
	rateLimitFleetScript = redisconn.NewScript(rateLimitFleetLua)
)

// instanceID names this process in the heartbeats: one id per process, so
// a config reload (new handlers, same process) adds no instance.
var instanceID = uuid.NewString()

// instancePerClient makes the instance id one per Redis client instead of
// per process, so that tests can run two "instances" in one process (two
// sites with their own clients). Set only by TestMain.
var instancePerClient bool

const (
	fleetTick      = 500 * time.Millisecond
	localTick      = 100 * time.Millisecond // fail_local, while Redis is not known to answer
	heartbeatEvery = time.Second
	// A heartbeat lives about three periods: an instance that stops (or
	// whose Redis link broke) no longer counts after it.
	heartbeatLife = 3 * heartbeatEvery
	// resetsKept is how long a reset stays listed for the other instances.
	resetsKept = 10 * time.Second
)

// fleet is a handler's view of the other instances.
type fleet struct {
	// A rejection may be in the deny cache until then (UnixNano, local).
	denyUntil atomic.Int64
	// The number of instances seen in the last heartbeat read (0: none yet).
	instances atomic.Int64
	// The latest reset seen (its score, Redis TIME in µs); loop goroutine
	// only.
	since float64
	// Record heartbeats (fail_local).
	beats bool
	// The handler's deny cache and logger as Provision left them: the loop
	// reads no field a later change of the handler could race with.
	deny   *ratelimit.DenyCache
	logger *zap.Logger
	member string // this instance's heartbeat id
	// Woken when Redis answered a decision while local admissions wait to
	// be charged.
	wake chan struct{}
}

// fleetKeys are the heartbeat and reset sets of the handler's prefix. The
// hash tag holds a character no limit id starts with, and the suffixes are
// none of a rate's, so they never mix with a limit's keys.
func (h *RedisRateLimit) fleetKeys() []string {
	return []string{h.Prefix + "{~fleet}:instances", h.Prefix + "{~fleet}:resets"}
}

// instance is this instance's heartbeat id.
func (h *RedisRateLimit) instance() string {
	if instancePerClient {
		return instanceID + "/" + keyHash(h.clientKey)
	}
	return instanceID
}

// noteDeny records that the deny cache holds a rejection until until.
func (f *fleet) noteDeny(until time.Time) {
	u := until.UnixNano()
	for {
		cur := f.denyUntil.Load()
		if cur >= u || f.denyUntil.CompareAndSwap(cur, u) {
			return
		}
	}
}

// startFleet starts the handler's fleet loop, stopped with ctx (the
// config's). Its first call comes a tick later, so `caddy validate`
// (Provision then Cleanup) calls no Redis.
func (h *RedisRateLimit) startFleet(ctx context.Context, beats bool) {
	if h.deny == nil && !beats {
		return
	}
	h.fleet = &fleet{beats: beats, wake: make(chan struct{}, 1), deny: h.deny, logger: h.logger, member: h.instance()}
	go h.fleetLoop(ctx)
}

func (h *RedisRateLimit) fleetLoop(ctx context.Context) {
	defer func() {
		if v := recover(); v != nil {
			h.fleet.logger.Error("rate-limit fleet loop panicked; resets from other instances and heartbeats stop for this handler",
				zap.Any("panic", v), zap.ByteString("stack", debug.Stack()))
		}
	}()
	t := time.NewTimer(fleetTick)
	defer t.Stop()
	var lastBeat time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-h.fleet.wake:
		}
		local := h.local != nil && h.local.mode.Load()
		// In local mode the heartbeat is tried every localTick: its answer
		// tells that Redis answers again, and the local admissions are
		// charged at once (another instance may decide by Redis already).
		if local {
			t.Reset(localTick)
		} else {
			t.Reset(fleetTick)
		}
		now := time.Now()
		beat := h.fleet.beats && (now.Sub(lastBeat) >= heartbeatEvery-fleetTick/2 || local)
		ok := h.fleetCall(ctx, now, beat)
		if ok && beat {
			lastBeat = now
		}
		// Redis answers again: charge it with what was admitted locally.
		if h.local != nil && (ok || !h.local.mode.Load()) && h.local.lim.Pending() {
			h.chargeLocal(ctx)
		}
	}
}

// fleetCall records a heartbeat (beat) and reads the count of instances,
// and, while the deny cache may hold a rejection, reads the resets since
// the last look (a plain ZRANGEBYSCORE: no script call, so a key answered
// from the deny cache still costs Redis no script). It reports whether
// Redis answered.
func (h *RedisRateLimit) fleetCall(ctx context.Context, now time.Time, beat bool) bool {
	poll := h.fleet.deny != nil && now.UnixNano() < h.fleet.denyUntil.Load()
	if !beat && !poll {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	keys := h.fleetKeys()
	var err error
	if beat {
		var res []any
		res, err = rateLimitFleetScript.Run(ctx, h.client.client, keys, h.fleet.member, heartbeatLife.Microseconds(), "", resetsKept.Microseconds()).Slice()
		if err == nil && len(res) != 2 {
			err = fmt.Errorf("unexpected answer of %d values", len(res))
		}
		if err == nil {
			if n, _ := res[1].(int64); n > 0 {
				h.fleet.instances.Store(n)
			}
		}
	}
	if poll && err == nil {
		var zs []redis.Z
		since := "(" + strconv.FormatFloat(h.fleet.since, 'f', -1, 64)
		if zs, err = h.client.client.ZRangeByScoreWithScores(ctx, keys[1], &redis.ZRangeBy{Min: since, Max: "+inf"}).Result(); err == nil {
			for _, z := range zs {
				if id, ok := z.Member.(string); ok {
					h.fleet.deny.Forget(id)
					if h.local != nil {
						h.local.lim.Forget(h.keyHead + id + "}")
					}
				}
				h.fleet.since = max(h.fleet.since, z.Score)
			}
		}
	}
	if err != nil {
		if c := h.fleet.logger.Check(zap.DebugLevel, "rate-limit fleet call failed"); c != nil {
			c.Write(zap.Error(err))
		}
		return false
	}
	return true
}

// noticeReset tells the other instances that the quota of id was reset
// (their deny caches forget it within about a second).
func (h *RedisRateLimit) noticeReset(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	return rateLimitFleetScript.Run(ctx, h.client.client, h.fleetKeys(), "", heartbeatLife.Microseconds(), id, resetsKept.Microseconds()).Err()
}

package redisratelimit

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
)

// Admin resets across the fleet: the instance whose admin API resets a
// key's quota or lifts its ban publishes it (ratelimit's Limit.Reset); every
// instance's listener (one per pooled client, started with its batcher)
// makes every handler on that client with that prefix forget the key: in
// its deny cache, and with fail_local in its local limiter. This is the one
// way a reset reaches the other instances.
//
// Bans travel the same way: the instance whose decision starts a ban
// publishes it (Limit.AnnounceBan), and every instance holds it in the
// deny cache of every handler on that client with that prefix and a ban,
// until it ends, so it holds there through an outage and in local mode.
// A resubscription (ratelimit.Forgetter.Resubscribed) keeps the bans: to be
// checked with Redis on the key's next request when Redis runs the same
// process (a lift may have been missed), written back when it runs a new
// one (it may have lost them).

// resetRegistry holds the provisioned redis_ratelimit handlers that keep
// something of a key in memory (a deny cache, a fail_local limiter), with
// what a reset reaches of them, as Provision left it.
var resetRegistry struct {
	mu sync.Mutex
	hs map[*RedisRateLimit]resetTarget
}

// resetTarget is what a reset reaches of one handler.
type resetTarget struct {
	client *shared.Client
	prefix string
	limit  *ratelimit.Limit
	bans   bool                 // the handler bans: it holds announced bans
	deny   *ratelimit.DenyCache // nil without
	local  *ratelimit.Local     // fail_local; nil without
	// announced: the keys whose rate_limit_exceeded went out this period;
	// a reset starts a new one.
	announced *ratelimit.DenyCache
}

// forget drops id in t's deny cache and local limiter.
func (t resetTarget) forget(id string) {
	if t.local != nil {
		t.local.Forget(t.limit.KeysOf(id))
	}
	if t.deny != nil {
		t.deny.Forget(id)
	}
	if t.announced != nil {
		t.announced.Forget(id)
	}
}

// registerResets adds h (its Provision), when it keeps anything a reset
// must reach.
func registerResets(h *RedisRateLimit) {
	t := resetTarget{client: h.client, prefix: h.Prefix, limit: h.limit, bans: h.ban() > 0, deny: h.deny, announced: h.announced}
	if h.local != nil {
		t.local = h.local.lim
	}
	if t.deny == nil && t.local == nil && t.announced == nil {
		return
	}
	resetRegistry.mu.Lock()
	defer resetRegistry.mu.Unlock()
	if resetRegistry.hs == nil {
		resetRegistry.hs = make(map[*RedisRateLimit]resetTarget)
	}
	resetRegistry.hs[h] = t
}

// unregisterResets removes h (its Cleanup).
func unregisterResets(h *RedisRateLimit) {
	resetRegistry.mu.Lock()
	defer resetRegistry.mu.Unlock()
	delete(resetRegistry.hs, h)
}

func init() {
	shared.ForgetterOf = func(c *shared.Client) ratelimit.Forgetter { return resetForgetter{c} }
}

// resetForgetter forgets what a reset published by any instance says, in
// the handlers on one pooled client (the one whose listener heard it).
type resetForgetter struct{ client *shared.Client }

// Forget drops id in the handlers on the client under prefix.
func (f resetForgetter) Forget(prefix, id string) {
	resetRegistry.mu.Lock()
	defer resetRegistry.mu.Unlock()
	for _, t := range resetRegistry.hs {
		if t.client == f.client && t.prefix == prefix {
			t.forget(id)
		}
	}
}

// Ban holds a ban announced by any instance in the handlers on the client
// under prefix that ban.
func (f resetForgetter) Ban(prefix, id string, left, retry time.Duration) {
	held := 0
	resetRegistry.mu.Lock()
	for _, t := range resetRegistry.hs {
		if t.client == f.client && t.prefix == prefix && t.bans && t.deny != nil {
			t.deny.Announced(id, left, retry)
			held++
		}
	}
	resetRegistry.mu.Unlock()
	if held > 0 {
		f.client.Users.Slogger("rl")().Debug("ban announced: held until it ends", slog.String("key", id), slog.Duration("ban_left", left))
	}
}

// Resubscribed empties the deny caches of the handlers on the client (a
// reset may have been missed) but for their bans, which hold until they
// end: checked with Redis on their key's next request when Redis runs the
// process it ran before (a lift may have been missed), written back to a
// new process (it may have lost them). Local limiters keep their state: it
// holds admissions not yet charged to Redis, and a missed reset only leaves
// them stricter than needed until the key's windows pass.
func (f resetForgetter) Resubscribed(newProcess bool) {
	var kept []ratelimit.KeptBan
	resetRegistry.mu.Lock()
	for _, t := range resetRegistry.hs {
		if t.client != f.client {
			continue
		}
		if t.deny != nil {
			kept = append(kept, t.deny.KeepBans(!newProcess, t.limit)...)
		}
		if t.announced != nil {
			t.announced.Clear()
		}
	}
	resetRegistry.mu.Unlock()
	if newProcess && len(kept) > 0 {
		f.writeBack(kept)
	}
}

// writeBack writes the bans this instance holds back to a new Redis process
// (ratelimit.WriteBackBans), on the listener's goroutine: a reset that
// arrives meanwhile is applied after it.
func (f resetForgetter) writeBack(kept []ratelimit.KeptBan) {
	log := f.client.Users.Slogger("rl")()
	ctx, cancel := context.WithTimeout(context.Background(), max(4*f.client.Settings.Timeout, 2*time.Second))
	defer cancel()
	n, err := ratelimit.WriteBackBans(ctx, f.client.Redis, kept)
	if err != nil {
		log.Warn("redis runs a new process: writing back the bans this instance holds failed; this instance holds them until they end",
			slog.Int("bans", len(kept)), slog.Int("written", n), slog.Any("error", err))
		return
	}
	log.Info("redis runs a new process: the bans this instance holds were written back",
		slog.Int("bans", len(kept)), slog.Int("written", n))
}

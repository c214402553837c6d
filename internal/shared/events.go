package shared

// Caddy events (the events app): redis_lock_lost, redis_lock_forced,
// rate_limit_exceeded, rate_limit_banned. Any handler module of Caddy's events.handlers
// namespace receives them, e.g. `events { on redis_lock_lost exec ... }`.
// Handlers run synchronously on the emitting goroutine, so an event is
// built only when something subscribes, and a rejection is announced at
// most once per key per deny-cache period. Events emitted while a config
// unloads may be lost.

import (
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// Event names.
const (
	EventLockLost          = "redis_lock_lost"
	EventLockForced        = "redis_lock_forced"
	EventRateLimitExceeded = "rate_limit_exceeded"
	EventRateLimitBanned   = "rate_limit_banned"
)

// Emitter emits a handler's events through the handler's own context, so
// their origin is the handler's module.
type Emitter struct {
	ctx caddy.Context
	app *caddyevents.App // nil: no events app (a module provisioned alone)
}

// NewEmitter finds the events app of the handler's config; without one
// configured nothing subscribes, and nothing is emitted.
func NewEmitter(ctx caddy.Context) (e Emitter) {
	// A module provisioned outside a loaded config (from Go code, as the
	// tests do) has a Context without a config, on which looking up an app
	// panics: it then has no events app.
	defer func() {
		if recover() != nil {
			e = Emitter{}
		}
	}()
	if a, err := ctx.AppIfConfigured("events"); err == nil {
		if app, ok := a.(*caddyevents.App); ok {
			return Emitter{ctx: ctx, app: app}
		}
	}
	return Emitter{}
}

// Emit sends the event when something can observe it; data is built only
// then.
func (e Emitter) Emit(name string, data func() map[string]any) {
	if e.app == nil || !e.app.ShouldEmit(name) {
		return
	}
	e.app.Emit(e.ctx, name, data())
}

// EventKey is a rendered key as events carry it: hashed when the key is
// stored hashed (long, or with braces), as in Redis.
func EventKey(rendered string) string {
	if len(rendered) > MaxKeyLen || strings.ContainsAny(rendered, "{}") || strings.HasPrefix(rendered, "sha256:") {
		return KeyHash(rendered)
	}
	return rendered
}

package shared

// Log lines of pooled parts. A pooled client and its parts (the lock
// releaser and wake-up listener, the server checks, the rate-limit
// Batcher) outlive configs and serve every handler with the same
// connection settings. Their log lines name a handler all the same: a
// line that names one (a release carries its lease's handler) goes to
// that handler's logger; a line of a part shared by several (a server
// Check) goes to each handler using the client. Either way it is written
// under the handler's module logger (http.handlers.redis_lock, ...), with
// the handler field.

import (
	"context"
	"log/slog"
	"sort"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// clientUsers are the loaded handlers using one pooled client.
type clientUsers struct {
	mu       sync.Mutex
	by       map[userKey]*clientUser
	lastKind string // of the handler that came last, for lines nobody gets
}

type userKey struct{ kind, label string }

type clientUser struct {
	// The loggers of the handlers with this kind and label (with their
	// handler field), in the order they came: during a reload the old
	// config's and the new one's. Lines go to the newest.
	loggers []*zap.Logger
}

// add records a handler of kind with label and logger as a user.
func (u *clientUsers) add(kind, label string, logger *zap.Logger) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.by == nil {
		u.by = map[userKey]*clientUser{}
	}
	k := userKey{kind, label}
	if u.by[k] == nil {
		u.by[k] = new(clientUser)
	}
	u.by[k].loggers = append(u.by[k].loggers, logger)
	u.lastKind = kind
}

// remove undoes the add with logger.
func (u *clientUsers) remove(kind, label string, logger *zap.Logger) {
	u.mu.Lock()
	defer u.mu.Unlock()
	k := userKey{kind, label}
	cu := u.by[k]
	if cu == nil {
		return
	}
	for i, lg := range cu.loggers {
		if lg == logger {
			cu.loggers = append(cu.loggers[:i:i], cu.loggers[i+1:]...)
			break
		}
	}
	if len(cu.loggers) == 0 {
		delete(u.by, k)
	}
}

// targets returns the loggers a line goes to: the one of handler (when
// the line names a user of kind), else every user of kind ("": any) in
// label order; fallback reports that none fits (the line then goes to
// Caddy's logger of the moment).
func (u *clientUsers) targets(kind, handler string) (out []*zap.Logger, named bool, fallbackKind string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	var keys []userKey
	for k := range u.by {
		switch {
		case kind != "" && k.kind != kind:
		case handler != "" && k.label != handler:
		default:
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].label != keys[j].label {
			return keys[i].label < keys[j].label
		}
		return keys[i].kind < keys[j].kind
	})
	if handler != "" && len(keys) > 1 {
		keys = keys[:1]
	}
	for _, k := range keys {
		lgs := u.by[k].loggers
		out = append(out, lgs[len(lgs)-1])
	}
	fallbackKind = kind
	if fallbackKind == "" {
		fallbackKind = u.lastKind
	}
	return out, handler != "" && len(out) > 0, fallbackKind
}

// moduleLogger names the module of a handler kind.
func moduleLogger(kind string) string {
	switch kind {
	case "rl":
		return "http.handlers.redis_ratelimit"
	case "fence":
		return "http.handlers.redis_fence"
	}
	return "http.handlers.redis_lock"
}

// Slogger returns the logger of a part serving handlers of kind ("": all).
func (u *clientUsers) Slogger(kind string) func() *slog.Logger {
	l := slog.New(&usersHandler{users: u, kind: kind})
	return func() *slog.Logger { return l }
}

// usersHandler is the slog.Handler of a pooled part: it writes each
// record to the loggers of the handlers it concerns.
type usersHandler struct {
	users *clientUsers
	kind  string
	ops   []func(slog.Handler) slog.Handler // WithAttrs and WithGroup, in order
}

// Enabled reports whether a line at l reaches any logger it may go to.
func (h *usersHandler) Enabled(ctx context.Context, l slog.Level) bool {
	loggers, _, fallbackKind := h.users.targets(h.kind, "")
	// A line naming a handler no longer loaded goes to Caddy's logger.
	loggers = append(loggers, caddy.Log().Named(moduleLogger(fallbackKind)))
	for _, lg := range loggers {
		if lg.Core().Enabled(zapLevel(l)) {
			return true
		}
	}
	return false
}

func (h *usersHandler) Handle(ctx context.Context, r slog.Record) error {
	var handler string
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "handler" {
			handler = a.Value.String()
			return false
		}
		return true
	})
	loggers, named, fallbackKind := h.users.targets(h.kind, handler)
	if named {
		// The handler's logger carries the field already.
		nr := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
		r.Attrs(func(a slog.Attr) bool {
			if a.Key != "handler" {
				nr.AddAttrs(a)
			}
			return true
		})
		r = nr
	}
	if len(loggers) == 0 {
		loggers = []*zap.Logger{caddy.Log().Named(moduleLogger(fallbackKind))}
	}
	for _, lg := range loggers {
		var out slog.Handler = SlogFor(lg).Handler()
		for _, op := range h.ops {
			out = op(out)
		}
		if out.Enabled(ctx, r.Level) {
			_ = out.Handle(ctx, r.Clone())
		}
	}
	return nil
}

func (h *usersHandler) with(op func(slog.Handler) slog.Handler) slog.Handler {
	ops := append(append([]func(slog.Handler) slog.Handler(nil), h.ops...), op)
	return &usersHandler{users: h.users, kind: h.kind, ops: ops}
}

func (h *usersHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return h.with(func(o slog.Handler) slog.Handler { return o.WithAttrs(as) })
}

func (h *usersHandler) WithGroup(name string) slog.Handler {
	return h.with(func(o slog.Handler) slog.Handler { return o.WithGroup(name) })
}

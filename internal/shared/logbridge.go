package shared

import (
	"context"
	"log/slog"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/throttle"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// The engines under internal/ log through log/slog (zap would pull in
// net/http); their lines reach Caddy's zap logger through zapHandler,
// with the same message, level, logger name and fields.

// SlogFor returns a slog.Logger that writes to z.
func SlogFor(z *zap.Logger) *slog.Logger {
	return slog.New(&zapHandler{core: z.Core(), name: z.Name()})
}

// zapHandler is a slog.Handler writing to a zap core.
type zapHandler struct {
	core   zapcore.Core
	name   string
	prefix string // the open groups, "a.b."
}

func (h *zapHandler) Enabled(_ context.Context, l slog.Level) bool {
	return h.core.Enabled(zapLevel(l))
}

func (h *zapHandler) Handle(_ context.Context, r slog.Record) error {
	ce := h.core.Check(zapcore.Entry{Level: zapLevel(r.Level), Time: r.Time, Message: r.Message, LoggerName: h.name}, nil)
	if ce == nil {
		return nil
	}
	fields := make([]zapcore.Field, 0, r.NumAttrs())
	r.Attrs(func(a slog.Attr) bool {
		fields = appendField(fields, h.prefix, a)
		return true
	})
	ce.Write(fields...)
	return nil
}

func (h *zapHandler) WithAttrs(as []slog.Attr) slog.Handler {
	fields := make([]zapcore.Field, 0, len(as))
	for _, a := range as {
		fields = appendField(fields, h.prefix, a)
	}
	return &zapHandler{core: h.core.With(fields), name: h.name, prefix: h.prefix}
}

func (h *zapHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	return &zapHandler{core: h.core, name: h.name, prefix: h.prefix + name + "."}
}

// appendField adds a as zap fields (a group's attributes flattened).
func appendField(fields []zapcore.Field, prefix string, a slog.Attr) []zapcore.Field {
	v := a.Value.Resolve()
	key := prefix + a.Key
	switch v.Kind() {
	case slog.KindGroup:
		p := prefix
		if a.Key != "" {
			p = key + "."
		}
		for _, g := range v.Group() {
			fields = appendField(fields, p, g)
		}
		return fields
	case slog.KindString:
		return append(fields, zap.String(key, v.String()))
	case slog.KindInt64:
		return append(fields, zap.Int64(key, v.Int64()))
	case slog.KindUint64:
		return append(fields, zap.Uint64(key, v.Uint64()))
	case slog.KindFloat64:
		return append(fields, zap.Float64(key, v.Float64()))
	case slog.KindBool:
		return append(fields, zap.Bool(key, v.Bool()))
	case slog.KindDuration:
		return append(fields, zap.Duration(key, v.Duration()))
	case slog.KindTime:
		return append(fields, zap.Time(key, v.Time()))
	}
	if a.Key == "" && v.Any() == nil {
		return fields
	}
	return append(fields, zap.Any(key, v.Any()))
}

// Warnings keeps repeated warnings out of the logs (internal/throttle).
type Warnings = throttle.Warnings

func NewWarnings(every time.Duration) *Warnings { return throttle.New(every) }

// zapLevel maps a slog level to zap's.
func zapLevel(l slog.Level) zapcore.Level {
	switch {
	case l >= slog.LevelError:
		return zapcore.ErrorLevel
	case l >= slog.LevelWarn:
		return zapcore.WarnLevel
	case l >= slog.LevelInfo:
		return zapcore.InfoLevel
	}
	return zapcore.DebugLevel
}

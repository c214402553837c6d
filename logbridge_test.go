package redisdlm

import (
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestSlogForWritesZapLines: an engine's slog line reaches the zap logger
// with its level, message, logger name and fields (an error as "error",
// a group flattened), and a level zap does not log is not built.
func TestSlogForWritesZapLines(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.InfoLevel)
	lg := shared.SlogFor(zap.New(core).Named("redisdlm"))
	if lg.Enabled(t.Context(), slog.LevelDebug) {
		t.Error("debug is enabled on an info logger")
	}
	lg.Debug("hidden")
	lg.With(slog.String("server", "s1")).WithGroup("g").Warn("releasing failed",
		slog.Any("error", errors.New("i/o timeout")), slog.Int64("n", 3), slog.Duration("d", time.Second))
	all := logs.All()
	if len(all) != 1 {
		t.Fatalf("%d lines, want 1: %v", len(all), all)
	}
	e := all[0]
	if e.Level != zapcore.WarnLevel || e.Message != "releasing failed" || e.LoggerName != "redisdlm" {
		t.Errorf("line %v %q %q, want warn, the message and the logger name", e.Level, e.Message, e.LoggerName)
	}
	f := e.ContextMap()
	if f["server"] != "s1" || f["g.error"] != "i/o timeout" || f["g.n"] != int64(3) || f["g.d"] != time.Second {
		t.Errorf("fields %v", f)
	}
}

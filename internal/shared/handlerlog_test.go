package shared

import (
	"log/slog"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestPooledPartLogTargets: a pooled part's line that names a handler goes
// to that handler's logger only (the newest one's while a reload runs both
// configs, the older again if the newer goes first, as after a failed
// reload); a line naming none goes to every handler of the part's kind.
func TestPooledPartLogTargets(t *testing.T) {
	t.Parallel()
	core := func() (*zap.Logger, *observer.ObservedLogs) {
		c, logs := observer.New(zapcore.DebugLevel)
		return zap.New(c), logs
	}
	oldA, oldLogs := core()
	newA, newLogs := core()
	b, bLogs := core()
	rl, rlLogs := core()
	u := new(clientUsers)
	u.add("lock", "a", oldA.With(zap.String("handler", "a")))
	u.add("lock", "b", b.With(zap.String("handler", "b")))
	u.add("rl", "r", rl.With(zap.String("handler", "r")))
	newALogger := newA.With(zap.String("handler", "a"))
	u.add("lock", "a", newALogger) // a reload: the new config's handler a
	lg := u.Slogger("lock")()

	lg.Warn("releasing a lock failed", slog.String("handler", "a"), slog.String("server", "s"))
	if newLogs.Len() != 1 || oldLogs.Len() != 0 || bLogs.Len() != 0 || rlLogs.Len() != 0 {
		t.Fatalf("a line naming a went to new %d, old %d, b %d, rl %d; want the newest a only", newLogs.Len(), oldLogs.Len(), bLogs.Len(), rlLogs.Len())
	}
	if f := newLogs.All()[0].Context; len(f) != 2 || f[0].Key != "handler" || f[1].Key != "server" {
		t.Errorf("fields %v, want the handler field once and server", f)
	}
	lg.Error("panic in the wake-up listener")
	if newLogs.Len() != 2 || bLogs.Len() != 1 || oldLogs.Len() != 0 || rlLogs.Len() != 0 {
		t.Errorf("a line naming no handler reached new a %d, b %d, old a %d, rl %d; want each lock handler once", newLogs.Len()-1, bLogs.Len(), oldLogs.Len(), rlLogs.Len())
	}
	u.remove("lock", "a", newALogger) // the new config failed and is cleaned up first
	lg.Warn("releasing a lock failed", slog.String("handler", "a"))
	if oldLogs.Len() != 1 || newLogs.Len() != 2 {
		t.Errorf("after the newer a went: old a got %d, new a %d more; want the old one", oldLogs.Len(), newLogs.Len()-2)
	}
}

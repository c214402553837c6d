package lock

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestReleaseFailureLogNamesServerAndHandler: the warning about a release
// that Redis did not answer names the server and the handler; the key only
// at debug level (and hashed at warn).
func TestReleaseFailureLogNamesServerAndHandler(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	r := rs[0]
	o := testOptions()
	o.Timeout, o.Handler = 300*time.Millisecond, "payments"
	l, _ := testLocker(t, rs, o)
	logs := &logRecorder{}
	l.servers[0].logger = func() *slog.Logger { return slog.New(logs) }
	key := "caddy:lock:{/secret-key}"
	ls, err := l.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatal(err)
	}
	r.Pause()
	ls.Release()
	r.Resume()
	if !allFree(5*time.Second, key, rs) {
		t.Fatal("the release was not retried")
	}
	var warns, debug []logRecord
	for _, rec := range logs.matching("releasing a lock failed") {
		switch rec.level {
		case slog.LevelWarn:
			warns = append(warns, rec)
		case slog.LevelDebug:
			if rec.attrs["key"] == key {
				debug = append(debug, rec)
			}
		}
	}
	if len(warns) == 0 {
		t.Fatalf("no warning about the failed release: %v", logs.matching(""))
	}
	f := warns[0].attrs
	if f["server"] != r.Addr || f["handler"] != "payments" {
		t.Errorf("the warning names server %v and handler %v, want %s and payments", f["server"], f["handler"], r.Addr)
	}
	for name, v := range f {
		if strings.Contains(fmt.Sprint(v), "secret-key") {
			t.Errorf("the warning names the key in %s at warn level", name)
		}
	}
	if f["key_hash"] != WakeID(key) {
		t.Errorf("the warning's key_hash is %v, want %s", f["key_hash"], WakeID(key))
	}
	if len(debug) == 0 {
		t.Errorf("no debug line names the key: %v", logs.matching(""))
	}
}

package lock

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestQuorumFanOutRecoversPanic: a panic in one server's call of a Redlock
// fan-out is logged with its stack and counts as that server failing; the
// lock still works on the majority and the process lives on.
func TestQuorumFanOutRecoversPanic(t *testing.T) {
	t.Parallel()
	o := testOptions()
	o.Wait = 2 * time.Second
	l, fcs := testLocker(t, startServers(t, 3), o)
	logs := &logRecorder{}
	l.SetLogger(slog.New(logs))
	fcs[1].setHook(func(redis.Cmder, func() error) error { panic("hooked command exploded") })
	keys := []string{"caddy:lock:{/panic}"}
	for i := 0; i < 3; i++ {
		ls, err := l.Acquire(context.Background(), keys)
		if err != nil {
			t.Fatalf("acquire %d with one server panicking: %v", i, err)
		}
		ls.Release()
	}
	recs := logs.matching("panic")
	if len(recs) == 0 {
		t.Fatal("the panics were not logged")
	}
	if recs[0].attrs["stack"] == "" || recs[0].attrs["stack"] == nil {
		t.Fatalf("the panic is logged without its stack: %v", recs[0].attrs)
	}
}

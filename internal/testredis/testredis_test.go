package testredis

import (
	"context"
	"strings"
	"testing"
)

func TestRedisHelper(t *testing.T) {
	r := Start(t)
	if err := r.Client().Set(context.Background(), "a", "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	r.Restart()
	if n, _ := r.Client().Exists(context.Background(), "a").Result(); n != 0 {
		t.Fatalf("restart should come back empty, exists=%d", n)
	}
}

// fatalTB records a Fatalf and stops the caller there, as testing.T does.
type fatalTB struct {
	testing.TB
	msg string
}

type stopped struct{}

func (f *fatalTB) Helper() {}
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = format
	panic(stopped{})
}

// TestStartFailsWithoutRedisServer: a missing redis-server fails the test
// (never skips it), naming what is missing.
func TestStartFailsWithoutRedisServer(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	f := &fatalTB{TB: t}
	func() {
		defer func() {
			if r := recover(); r != nil {
				if _, ok := r.(stopped); !ok {
					panic(r)
				}
			}
		}()
		Start(f)
	}()
	if !strings.Contains(f.msg, "redis-server is required") {
		t.Fatalf("Start without redis-server in PATH: Fatalf %q, want it to fail naming redis-server", f.msg)
	}
}

package redisdlm

import (
	"flag"
	"os"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
)

// TestMain runs more tests at once than -parallel's default (GOMAXPROCS):
// most of them wait on Redis servers and timers, not on the CPU. Eight, not
// more: with -race on two cores, sixteen at once pushed calls past their
// 500ms timeout often enough to fail a test now and then. An explicit
// -parallel wins.
func TestMain(m *testing.M) {
	if os.Getenv(testCaddyEnv) != "" {
		runAsTestCaddy() // a Caddy process of a test (caddyproc_test.go)
	}
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "test.parallel" {
			set = true
		}
	})
	if !set {
		_ = flag.Set("test.parallel", "8")
	}
	// A client whose handlers went away closes this long after (10 s in
	// Caddy): shorter here, so tests that watch it close need not wait.
	shared.DestructGrace = 500 * time.Millisecond
	os.Exit(m.Run())
}

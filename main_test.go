package redisdlm

import (
	"os"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// TestMain is testkit.Main (more tests at once, a short DestructGrace),
// unless the binary runs as a Caddy process of a test.
func TestMain(m *testing.M) {
	if os.Getenv(testCaddyEnv) != "" {
		runAsTestCaddy() // a Caddy process of a test (caddyproc_test.go)
	}
	testkit.Main(m)
}

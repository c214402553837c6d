package redisdlm

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
)

// provisionable is a handler that Caddy provisions and cleans up.
type provisionable interface {
	caddy.Provisioner
	caddy.CleanerUpper
}

// checkRoundTrip checks what a Caddyfile parser accepted, the way Caddy
// uses it: its JSON form unmarshals into a fresh handler with the same JSON,
// and Provision of that either succeeds (Cleanup then releases what it took)
// or fails with an error that names the directive. Provision never dials.
// Configs naming files (TLS) are not provisioned: a fuzzed path could be a
// device that never ends.
func checkRoundTrip(t *testing.T, dir string, parsed any, conn *shared.RedisConfig, fresh provisionable) {
	t.Helper()
	b1, err := json.Marshal(parsed)
	if err != nil {
		t.Fatalf("%s: JSON form of an accepted config: %v", dir, err)
	}
	if err := json.Unmarshal(b1, fresh); err != nil {
		t.Fatalf("%s: JSON %s does not unmarshal: %v", dir, b1, err)
	}
	b2, _ := json.Marshal(fresh)
	if !bytes.Equal(b1, b2) {
		t.Fatalf("%s: JSON round trip changed the config:\n%s\n%s", dir, b1, b2)
	}
	if conn.TLSCAFile != "" || conn.TLSClientCertFile != "" || conn.TLSClientKeyFile != "" {
		return
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	err = fresh.Provision(ctx)
	_ = fresh.Cleanup()
	if err != nil && !strings.Contains(err.Error(), dir) {
		t.Fatalf("%s: Provision of %s: error does not name the directive: %v", dir, b1, err)
	}
}

// checkParseError fails unless a parse error names the directive.
func checkParseError(t *testing.T, dir string, err error) {
	t.Helper()
	if err != nil && !strings.Contains(err.Error(), dir) {
		t.Fatalf("parse error does not name the directive %s: %v", dir, err)
	}
}

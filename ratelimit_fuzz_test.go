package redisdlm

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzRateLimitCaddyfile: the parser never panics, and what it accepts
// passes Validate.
func FuzzRateLimitCaddyfile(f *testing.F) {
	for _, s := range []string{
		"redis_ratelimit {\n rate 10 1s\n}",
		"redis_ratelimit {\n rate 10 1s\n rate 100 1h\n algorithm gcra\n burst 5\n key {client_ip}\n}",
		"redis_ratelimit {\n rate 0 1s\n status 99\n}",
		"redis_ratelimit {\n redis redis://:x@h:1/2\n rate 1 1ms\n prefix p:\n headers off\n dry_run\n}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		tokens, err := caddyfile.Tokenize([]byte(in), "Testfile")
		if err != nil {
			return
		}
		var h RedisRateLimit
		if err := h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
			return
		}
		if strings.Contains(in, "{env.") || strings.Contains(in, "{file.") {
			return
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("parser accepted %q but Validate rejects it: %v", in, err)
		}
	})
}

// FuzzRateLimitKey: a rendered key maps to an id without braces and of
// bounded length, and distinct keys never share an id.
func FuzzRateLimitKey(f *testing.F) {
	f.Add("alice", "bob")
	f.Add("", "ip/192.0.2.1")
	f.Add(strings.Repeat("x", 300), "sha256:")
	f.Fuzz(func(t *testing.T, a, b string) {
		ia, ib := limitIDFor(a, "192.0.2.1"), limitIDFor(b, "192.0.2.1")
		for _, id := range []string{ia, ib} {
			if strings.ContainsAny(id, "{}") || len(id) > maxKeyLen+7 {
				t.Fatalf("id %q breaks the hash tag or is too long", id)
			}
		}
		if a != b && ia == ib {
			t.Fatalf("keys %q and %q share the id %q", a, b, ia)
		}
	})
}

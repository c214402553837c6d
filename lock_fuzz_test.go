package redisdlm

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzLockCaddyfile: the parser never panics, and what it accepts passes
// Validate (run with go test -fuzz FuzzLockCaddyfile).
func FuzzLockCaddyfile(f *testing.F) {
	for _, s := range []string{
		"key {http.request.header.X-User-ID}\nttl 10s\nwait 0",
		"redis 127.0.0.1:1 127.0.0.1:2 127.0.0.1:3\npermits 2",
		"backoff 1ms 2ms\nstatus 409\non_lost continue\nfail_open",
		"key {",
		"sentinel m 127.0.0.1:26379\ntls ca.pem\ntimeout 1s",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		d := caddyfile.NewTestDispenser("redis_lock {\n" + body + "\n}")
		h := new(RedisLock)
		if err := h.UnmarshalCaddyfile(d); err != nil {
			return
		}
		if err := h.Validate(); err != nil && !strings.Contains(err.Error(), "redis_lock") {
			t.Fatalf("validate error does not name the directive: %v", err)
		}
	})
}

// FuzzStoredKey: every rendered key maps to a Redis key whose hash tag
// covers the whole key (one Cluster slot for the lock, its counter and its
// wait list), and different keys never share a Redis key.
func FuzzStoredKey(f *testing.F) {
	for _, s := range []string{"alice", "a}b", "{x}", "sha256:00", strings.Repeat("y", 250)} {
		f.Add(s, "other")
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		ka, kb := storedKey("p:", a), storedKey("p:", b)
		if a != b && ka == kb {
			t.Fatalf("keys %q and %q share the Redis key %q", a, b, ka)
		}
		open := strings.IndexByte(ka, '{')
		close := strings.IndexByte(ka[open+1:], '}')
		if open < 0 || close < 0 || open+1+close != len(ka)-1 {
			t.Fatalf("Redis key %q: the hash tag must span the whole key", ka)
		}
		if len(ka) > len("p:{}")+maxKeyLen {
			t.Fatalf("Redis key %q longer than the bound", ka)
		}
	})
}

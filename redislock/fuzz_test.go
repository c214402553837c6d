package redislock

import (
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzLockCaddyfile: the parser never panics, its errors name the
// directive, and what it accepts passes Validate and round-trips
// Caddyfile → JSON → Provision (make fuzz runs it; the corpus in
// testdata/fuzz/FuzzLockCaddyfile is replayed by go test).
func FuzzLockCaddyfile(f *testing.F) {
	for _, s := range []string{
		"key {http.request.header.X-User-ID}\nttl 10s\nwait 0",
		"redis 127.0.0.1:1 127.0.0.1:2 127.0.0.1:3\npermits 2",
		"backoff 1ms 2ms\nstatus 409\non_lost continue\nfail_open",
		"key {",
		"sentinel m 127.0.0.1:26379\ntls ca.pem\ntimeout 1s",
		"redis rediss://u:p@h:6380/2\nusername x\npassword {env.PW}\ndb 3\ntls_client_cert c.pem c.key",
		"cluster 127.0.0.1:7000 redis://h:7001\nsync_replicas 1\nmax_waiters 10\nmax_hold 1m\nauto_extend off",
		"key {http.request.header.A} {query.b}\nfencing_header off\nprefix p:\nstatus 503",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		d := caddyfile.NewTestDispenser("redis_lock {\n" + body + "\n}")
		h := new(RedisLock)
		if err := h.UnmarshalCaddyfile(d); err != nil {
			testkit.CheckParseError(t, "redis_lock", err)
			return
		}
		if err := h.Validate(); err != nil && !strings.Contains(err.Error(), "redis_lock") {
			t.Fatalf("validate error does not name the directive: %v", err)
		}
		testkit.CheckRoundTrip(t, "redis_lock", h, &h.RedisConfig, new(RedisLock))
	})
}

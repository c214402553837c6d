package redislock

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// TestLockCaddyfileErrors: every bad input names the directive, the
// subdirective and the Caddyfile line, and nothing panics.
func TestLockCaddyfileErrors(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, in, want string }{
		{"unknown", "bogus 1", `unknown subdirective "bogus"`},
		{"key missing", "key", "key: needs a template"},
		{"key bad namespace", "key {foo.bar}", "key: "},
		{"key unclosed", "key {http.request.uri", "key: unclosed placeholder"},
		{"ttl missing", "ttl", "ttl: want exactly one argument"},
		{"ttl extra", "ttl 1s 2s", "ttl: want exactly one argument"},
		{"ttl bad", "ttl soon", `ttl: invalid duration "soon"`},
		{"ttl zero", "ttl 0s", "ttl: must be positive"},
		{"ttl negative", "ttl -1s", "ttl: must be positive"},
		{"wait bad", "wait x", `wait: invalid duration`},
		{"wait negative", "wait -1s", "wait: must not be negative"},
		{"backoff one", "backoff 10ms", "backoff: want <min> <max>"},
		{"backoff bad", "backoff 10ms x", `backoff: invalid duration "x"`},
		{"backoff inverted", "backoff 1s 10ms", "backoff: max 10ms is below min 1s"},
		{"backoff zero", "backoff 0s 1s", "backoff: durations must be positive"},
		{"auto_extend bad", "auto_extend maybe", "auto_extend: want on or off"},
		{"max_hold bad", "max_hold 0", "max_hold: must be positive"},
		{"permits zero", "permits 0", "permits: want an integer >= 1"},
		{"permits word", "permits many", "permits: want an integer >= 1"},
		{"max_waiters negative", "max_waiters -1", "max_waiters: want an integer >= 0"},
		{"fencing_header missing", "fencing_header", "fencing_header: want exactly one argument"},
		{"fencing_header bad", "fencing_header a:b", "fencing_header: "},
		{"fencing_header empty", `fencing_header ""`, "fencing_header: must not be empty"},
		{"fencing_header parenthesis", "fencing_header X(1)", `fencing_header: "X(1)" is not a valid header name`},
		{"fencing_header comma", "fencing_header A,B", `fencing_header: "A,B" is not a valid header name`},
		{"status low", "status 200", "status: want an HTTP status code in 400-599"},
		{"status high", "status 600", "status: want an HTTP status code in 400-599"},
		{"status word", "status locked", "status: want an HTTP status code"},
		{"on_lost bad", "on_lost explode", "on_lost: want cancel or continue"},
		{"fail_open arg", "fail_open yes", "fail_open: takes no argument"},
		{"sync_replicas bad", "sync_replicas -2", "sync_replicas: want an integer >= 0"},
		{"prefix missing", "prefix", "prefix: want exactly one argument"},
		{"prefix braces", "prefix a{b}:", "prefix: \"a{b}:\" must not contain braces"},
		{"redis missing", "redis", "redis: needs at least one address"},
		{"redis bad addr", "redis nohostport", `redis: invalid redis address "nohostport"`},
		{"redis bad port", "redis 127.0.0.1:99999", "redis: invalid redis address"},
		{"redis bad url", "redis http://x:1", "redis: invalid redis URL"},
		{"redis even", "redis 127.0.0.1:1 127.0.0.1:2", "redis: 2 servers given; a Redlock quorum needs an odd count"},
		{"redis even over lines", "redis 127.0.0.1:1\n\tredis 127.0.0.1:2", "at Testfile:3"},
		{"redis and cluster", "redis 127.0.0.1:1\n\tcluster 127.0.0.1:2", "mutually exclusive"},
		{"redis twice", "redis 127.0.0.1:1 127.0.0.1:1 127.0.0.1:2", `redis: "127.0.0.1:1" is listed twice; a Redlock quorum needs independent servers`},
		{"redis twice as URL", "redis 127.0.0.1:6379 redis://127.0.0.1:6379/0 127.0.0.1:2", "are the same Redis server 127.0.0.1:6379"},
		{"redis twice other db", "redis redis://LOCALHOST/1 localhost:6379 127.0.0.1:2", "are the same Redis server localhost:6379 (only host and port count, not the db)"},
		{"redis twice over lines", "redis 127.0.0.1:1 127.0.0.1:2\n\tredis 127.0.0.1:1", "(the first is at line 2), at Testfile:3"},
		{"replay_max overflow", "replay_max 17179869185GiB", `replay_max: invalid size "17179869185GiB": too large`},
		{"replay_max huge", "replay_max 9223372036854775807", "replay_max: 9223372036854775807 bytes is more than the largest allowed"},
		{"replay_max over cap", "replay_max 257MiB", "replay_max: 269484032 bytes is more than the largest allowed, 268435456 (256MiB)"},
		{"sentinel short", "sentinel mymaster", "sentinel: needs a master name and at least one sentinel address"},
		{"db bad", "db x", "db: want a non-negative integer"},
		{"tls extra", "tls a b", "tls: takes at most one argument"},
		{"timeout bad", "timeout 0", "timeout: must be positive"},
		{"username extra", "username a b", "username: want exactly one argument"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := "redis_lock {\n\t" + c.in + "\n}"
			d := caddyfile.NewTestDispenser(in)
			h := new(RedisLock)
			err := h.UnmarshalCaddyfile(d)
			if err == nil {
				t.Fatalf("no error for %q", c.in)
			}
			msg := err.Error()
			if !strings.Contains(msg, "redis_lock") || !strings.Contains(msg, c.want) {
				t.Errorf("error %q: want it to name redis_lock and contain %q", msg, c.want)
			}
			if !strings.Contains(msg, ":2") && !strings.Contains(msg, ":3") {
				t.Errorf("error %q does not name the Caddyfile line", msg)
			}
		})
	}
}

// TestLockCaddyfileValid: placeholders are accepted at parse time, and a
// parsed config passes Validate.
func TestLockCaddyfileValid(t *testing.T) {
	t.Parallel()
	d := caddyfile.NewTestDispenser(`redis_lock {
		key user:{http.request.header.X-User-ID}
		key {http.auth.user.id}
		password {env.REDIS_PASSWORD}
		redis redis://:{env.REDIS_PASSWORD}@127.0.0.1:6379/2 127.0.0.1:6380 127.0.0.1:6381
		wait 0
	}`)
	h := new(RedisLock)
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if h.Wait == nil || *h.Wait != 0 {
		t.Errorf("wait 0 not kept: %v", h.Wait)
	}
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestCaddyfileAdaptErrors: `caddy adapt` fails with the file and line for
// bad values.
func TestCaddyfileAdaptErrors(t *testing.T) {
	adapter := caddyconfig.GetAdapter("caddyfile")
	in := ":8080\n\nredis_lock /api/* {\n\tttl nope\n}\nrespond ok\n"
	_, _, err := adapter.Adapt([]byte(in), map[string]any{"filename": "Caddyfile"})
	if err == nil || !strings.Contains(err.Error(), "Caddyfile:4") || !strings.Contains(err.Error(), "redis_lock: ttl") {
		t.Fatalf("adapt error %v: want Caddyfile:4 and redis_lock: ttl", err)
	}
}

// TestFencingHeaderRule: fencing_header must
// not name a hop-by-hop header, Host, Content-Length, or a header the
// handler's keys, fingerprint or credentials read (compared
// case-insensitively). The Caddyfile parser names the line (fencing_header's,
// or the key's when the default header is read by a key); the same config
// in JSON fails Validate with the same reason.
func TestFencingHeaderRule(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, block string
		line        int
		want        string
	}{
		{"Connection", "fencing_header Connection", 2, `"Connection" is a hop-by-hop header`},
		{"Keep-Alive", "fencing_header keep-alive", 2, "is a hop-by-hop header"},
		{"Proxy-Authenticate", "fencing_header Proxy-Authenticate", 2, "is a hop-by-hop header"},
		{"Proxy-Authorization", "fencing_header proxy-authorization", 2, "is a hop-by-hop header"},
		{"Proxy-Connection", "fencing_header Proxy-Connection", 2, "is a hop-by-hop header"},
		{"Te", "fencing_header TE", 2, "is a hop-by-hop header"},
		{"Trailer", "fencing_header Trailer", 2, "is a hop-by-hop header"},
		{"Transfer-Encoding", "fencing_header Transfer-Encoding", 2, "is a hop-by-hop header"},
		{"Upgrade", "fencing_header upgrade", 2, "is a hop-by-hop header"},
		{"Host", "ttl 5s\n\tfencing_header Host", 3, `"Host" names the site the request is for`},
		{"Content-Length", "fencing_header content-length", 2, "frames the request body"},
		{"Authorization", "fencing_header Authorization", 2, "carries the client's credentials"},
		{"Cookie with credential_cookies", "replay 1m\n\tcredential_cookies session\n\tfencing_header Cookie", 4, "identifies the client under replay"},
		{"Cookie under replay", "replay 1m\n\tfencing_header cookie", 3, "identifies the client under replay"},
		{"a key's header", "key user:{http.request.header.X-User}\n\tfencing_header x-user", 3, `"x-user" is read by the key "user:{http.request.header.X-User}"`},
		{"a key's header, shorthand", "fencing_header X-USER\n\tkey {header.X-User}", 2, "is read by the key"},
		{"the second key's header", "key {http.request.uri.path}\n\tkey {http.request.header.X-Account}\n\tfencing_header X-Account", 4, "is read by the key"},
		{"a key's cookie", "key {http.request.cookie.session}\n\tfencing_header Cookie", 3, "is read by the key"},
		{"the fingerprint's header", "replay 1m\n\tfingerprint {method} {http.request.header.X-Body-Hash}\n\tfencing_header X-Body-Hash", 4, "is read by the fingerprint"},
		{"the default, read by a key", "ttl 5s\n\tkey {http.request.uri.path}\n\tkey {http.request.header.Lock-Fencing-Token}", 4, `"Lock-Fencing-Token" (the default) is read by the key`},
		{"the default, read by the fingerprint", "replay 1m\n\tfingerprint {header.lock-fencing-token}", 3, "(the default) is read by the fingerprint"},
		{"not a header name", "fencing_header X(1)", 2, "is not a valid header name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(RedisLock)
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\t" + tc.block + "\n}"))
			if err == nil || !strings.Contains(err.Error(), "redis_lock: fencing_header: ") || !strings.Contains(err.Error(), tc.want) ||
				!strings.Contains(err.Error(), fmt.Sprintf("Testfile:%d", tc.line)) {
				t.Fatalf("Caddyfile: %v; want redis_lock: fencing_header, %q and Testfile:%d", err, tc.want, tc.line)
			}
			raw, _ := json.Marshal(h) // what the parser had read: the same config in JSON
			j := new(RedisLock)
			if err := caddy.StrictUnmarshalJSON(raw, j); err != nil {
				t.Fatal(err)
			}
			if err := j.Validate(); err == nil || !strings.Contains(err.Error(), "redis_lock: fencing_header: ") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("JSON %s: Validate: %v; want %q", raw, err, tc.want)
			}
		})
	}
	// The neighbours stay valid.
	for _, block := range []string{
		"key {http.request.header.X-User}\n\tfencing_header X-Token",
		"key {http.request.header.X-User-ID}\n\tfencing_header X-User",
		"key {http.request.header.Lock-Fencing-Token}\n\tfencing_header off",
		"replay 1m\n\tfingerprint {http.request.header.X-Idem}\n\tcredential_cookies session\n\tfencing_header X-Token",
		"key {http.request.cookie.session}",
	} {
		h := new(RedisLock)
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\t" + block + "\n}")); err != nil {
			t.Errorf("Caddyfile %q: %v, want it accepted", block, err)
			continue
		}
		raw, _ := json.Marshal(h)
		j := new(RedisLock)
		if err := caddy.StrictUnmarshalJSON(raw, j); err != nil {
			t.Fatal(err)
		}
		if err := j.Validate(); err != nil {
			t.Errorf("JSON %s: Validate: %v, want it accepted", raw, err)
		}
	}
	// caddy adapt without --validate names the line.
	in := ":8080\n\nredis_lock {\n\tkey {http.request.header.X-User}\n\tfencing_header X-User\n}\nrespond ok\n"
	if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(in), map[string]any{"filename": "Caddyfile"}); err == nil ||
		!strings.Contains(err.Error(), "Caddyfile:5") || !strings.Contains(err.Error(), "redis_lock: fencing_header") {
		t.Errorf("adapt: %v; want redis_lock: fencing_header at Caddyfile:5", err)
	}
}

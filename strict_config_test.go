package redisdlm

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/redisfence"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestStrictConfig: what Caddy's own modules
// refuse is refused here too, naming the subdirective or field and, in the
// Caddyfile, the line. Before: a second ttl or key silently won, a
// misspelled request placeholder rendered empty for every request, and a
// JSON rate's unknown field was dropped ("requets" then read as
// "requests must be at least 1, got 0").
func TestStrictConfig(t *testing.T) {
	t.Parallel()
	type unmarshaler interface {
		UnmarshalCaddyfile(*caddyfile.Dispenser) error
	}
	for _, tc := range []struct {
		name, dir, block string
		want             []string
	}{
		{"ttl twice", "redis_lock", "ttl 10s\n\tttl 20s", []string{"redis_lock: ttl: given twice (first at line 2)", ":3"}},
		{"replay twice", "redis_lock", "replay 1m\n\treplay 2m", []string{"replay: given twice"}},
		{"timeout twice", "redis_lock", "timeout 1s\n\ttimeout 2s", []string{"timeout: given twice"}},
		{"rate-limit key twice", "redis_ratelimit", "rate 10 1m\n\tkey {client_ip}\n\tkey {http.request.header.X}", []string{"redis_ratelimit: key: given twice (first at line 3)", ":4"}},
		{"algorithm twice", "redis_ratelimit", "rate 10 1m\n\talgorithm gcra\n\talgorithm gcra", []string{"algorithm: given twice"}},
		{"lock key misspelled field", "redis_lock", "key {http.request.heder.X}", []string{"redis_lock: key", "http.request.heder.X", "does not exist", ":2"}},
		{"rate-limit key misspelled field", "redis_ratelimit", "rate 10 1m\n\tkey {http.request.remote_host}", []string{"redis_ratelimit: key", "does not exist"}},
		{"rate misspelled field", "redis_ratelimit", "rate {http.request.heder.X-Plan} 1m", []string{"redis_ratelimit: rate", "does not exist"}},
		{"cost misspelled field", "redis_ratelimit", "rate 10 1m\n\tcost {http.request.hedaer.X-Cost}", []string{"redis_ratelimit: cost", "does not exist"}},
		{"fingerprint misspelled field", "redis_lock", "replay 1m\n\tfingerprint {http.request.methd}", []string{"redis_lock: fingerprint", "does not exist"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h unmarshaler = new(redislock.RedisLock)
			if tc.dir == "redis_ratelimit" {
				h = new(redisratelimit.RedisRateLimit)
			}
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.dir + " {\n\t" + tc.block + "\n}"))
			for _, w := range tc.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Fatalf("%v; want an error containing %q", err, w)
				}
			}
		})
	}
	// Repeatable subdirectives stay repeatable.
	for _, ok := range []struct{ dir, block string }{
		{"redis_lock", "key {http.request.header.A}\n\tkey {http.request.header.B}"},
		{"redis_lock", "redis 127.0.0.1:1\n\tredis 127.0.0.1:2\n\tredis 127.0.0.1:3"},
		{"redis_ratelimit", "rate 10 1s\n\trate 100 1m\n\tcount 401\n\tcount 403"},
		{"redis_ratelimit", "rate 10 1s\n\tkey {http.request.uri.path.0}:{http.request.host.labels.1}:{http.request.remote.host/24,64}:{http.request.tls.client.subject}:{http.request.cookie.s}:{http.request.uri.query.q}"},
	} {
		var h unmarshaler = new(redislock.RedisLock)
		if ok.dir == "redis_ratelimit" {
			h = new(redisratelimit.RedisRateLimit)
		}
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(ok.dir + " {\n\t" + ok.block + "\n}")); err != nil {
			t.Errorf("%s {%s}: %v, want it accepted", ok.dir, ok.block, err)
		}
	}

	// JSON: the rates are decoded strictly, like the rest of a module's
	// JSON (caddy.StrictUnmarshalJSON), and placeholders are checked by
	// Validate.
	for _, tc := range []struct{ cfg, want string }{
		{`{"rates":[{"requests":5,"window":"1m","burst":5}]}`, `unknown field "burst"`},
		{`{"rates":[{"requets":5,"window":"1m"}]}`, `unknown field "requets"`},
		{`{"rates":[{"requests":5,"window":"1m"}],"key":"{http.request.heder.X}"}`, "does not exist"},
		{`{"rates":[{"requests":"{http.request.heder.X}","window":"1m"}]}`, "does not exist"},
	} {
		h := new(redisratelimit.RedisRateLimit)
		err := caddy.StrictUnmarshalJSON([]byte(tc.cfg), h)
		if err == nil {
			err = h.Validate()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("JSON %s: %v; want an error containing %q", tc.cfg, err, tc.want)
		}
	}
	h := new(redislock.RedisLock)
	if err := json.Unmarshal([]byte(`{"keys":["{http.request.heder.X}"]}`), h); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("JSON lock key {http.request.heder.X}: %v, want an error", err)
	}
}

// TestEmptyPrefix: `prefix ""` written in a
// Caddyfile is an error on every directive that has prefix, naming the
// directive, the subdirective and the line (it silently meant the
// default); in JSON an empty prefix is the default.
func TestEmptyPrefix(t *testing.T) {
	t.Parallel()
	type unmarshaler interface {
		UnmarshalCaddyfile(*caddyfile.Dispenser) error
		Validate() error
	}
	for _, tc := range []struct {
		dir, block string
		h          func() unmarshaler
	}{
		{"redis_lock", "ttl 5s\n\tprefix \"\"", func() unmarshaler { return new(redislock.RedisLock) }},
		{"redis_ratelimit", "rate 10 1m\n\tprefix \"\"", func() unmarshaler { return new(redisratelimit.RedisRateLimit) }},
		{"redis_fence", "retain 1h\n\tprefix \"\"", func() unmarshaler { return new(redisfence.RedisFence) }},
	} {
		err := tc.h().UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.dir + " {\n\t" + tc.block + "\n}"))
		if err == nil || !strings.Contains(err.Error(), tc.dir+": prefix: must not be empty") || !strings.Contains(err.Error(), "Testfile:3") {
			t.Errorf("%s with prefix \"\": %v; want %s: prefix: must not be empty, at Testfile:3", tc.dir, err, tc.dir)
		}
		h := tc.h()
		if err := json.Unmarshal([]byte(`{"prefix":""}`), h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err != nil && strings.Contains(err.Error(), "prefix") {
			t.Errorf("%s in JSON with \"prefix\":\"\": %v, want the default", tc.dir, err)
		}
	}
	h := provisionFence(t, `{"redis":["127.0.0.1:1"],"prefix":""}`) // never dials
	if h.Prefix != redisfence.DefaultFencePrefix {
		t.Errorf(`redis_fence in JSON with "prefix":"": prefix %q, want the default %q`, h.Prefix, redisfence.DefaultFencePrefix)
	}
}

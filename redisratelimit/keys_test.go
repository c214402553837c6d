package redisratelimit

import (
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestKeyWithEmptyPlaceholder: a key in which one placeholder renders empty
// or unknown never becomes a shared key ("user:" for everyone without the
// header): the rate limiter limits by client IP. (The lock, which answers
// 400: redislock's TestKeyWithEmptyPlaceholder.)
func TestKeyWithEmptyPlaceholder(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	rl := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Key = "user:{http.request.header.X-User}"
		h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(60e9)}}
	})
	if a := serveRL(rl, "192.0.2.1", nil); !a.passed {
		t.Fatal("first client without the header rejected")
	}
	if a := serveRL(rl, "192.0.2.2", nil); !a.passed {
		t.Fatal("a second client without the header shared the first one's bucket")
	}
	if a := serveRL(rl, "192.0.2.1", nil); a.passed {
		t.Fatal("the first client's own (client-IP) bucket did not limit it")
	}
}

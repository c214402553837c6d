package redisratelimit

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRateLimitRedisDown: with Redis killed or paused, decisions follow the
// fail policy (admit, or 503 with fail_closed; never 500) within about the
// timeout, the breaker stops calling Redis, the warning is not repeated per
// request, and decisions come from Redis again after it returns, without
// re-provisioning.
func TestRateLimitRedisDown(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	const bound = timeout + 1200*time.Millisecond // generous for a loaded machine
	for _, fault := range []string{"kill", "pause"} {
		for _, closed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/fail_closed=%v", fault, closed), func(t *testing.T) {
				t.Parallel()
				r := startRedis(t)
				h := newRateLimit(t, r, func(h *RedisRateLimit) {
					h.Rates = []Rate{{Requests: 1, Window: caddy.Duration(time.Minute)}}
					h.FailClosed = closed
					h.Timeout = caddy.Duration(timeout)
				})
				core, logs := observer.New(zapcore.WarnLevel)
				h.logger = zap.New(core)

				// With Redis up a request is admitted (the first call loads
				// the script and dials: on a loaded machine it may exceed
				// the short timeout, so a few tries, each with a key of its own).
				try := 0
				if !waitFor(5*time.Second, func() bool { try++; return try < 10 && serveRL(h, fmt.Sprintf("192.0.2.%d", 29+try), nil).passed }) {
					t.Fatal("no request admitted with Redis up")
				}
				if fault == "kill" {
					r.Kill()
				} else {
					r.Pause()
					defer r.Resume()
				}

				check := func(a rlAnswer, what string) {
					t.Helper()
					if a.elapsed > bound {
						t.Errorf("%s: decision took %s with Redis down, bound %s", what, a.elapsed, bound)
					}
					if closed {
						if a.passed || a.status != http.StatusServiceUnavailable {
							t.Errorf("%s: fail_closed: want 503, got passed=%v status %d", what, a.passed, a.status)
						}
					} else if !a.passed || a.err != nil {
						t.Errorf("%s: fail open: want admitted, got status %d err %v", what, a.status, a.err)
					}
				}
				for i := 0; i < 8; i++ {
					check(serveRL(h, fmt.Sprintf("192.0.2.%d", 40+i), nil), fmt.Sprintf("sequential %d", i))
				}
				var wg sync.WaitGroup
				for i := 0; i < 20; i++ {
					wg.Add(1)
					go func(i int) {
						defer wg.Done()
						check(serveRL(h, fmt.Sprintf("192.0.2.%d", 60+i), nil), fmt.Sprintf("concurrent %d", i))
					}(i)
				}
				wg.Wait()
				if !h.client.Batcher().BreakerOpen() {
					t.Fatal("breaker not open after repeated failures")
				}
				if n := logs.FilterMessageSnippet("redis unavailable").Len(); n != 1 {
					t.Fatalf("%d fail-policy warnings for 29 decisions, want 1 (rate-limited)", n)
				}

				if fault == "kill" {
					r.Restart()
				} else {
					r.Resume()
				}
				// Recovery by itself: a key gets one request a minute again.
				deadline := time.Now().Add(15 * time.Second)
				for i := 0; ; i++ {
					ip := fmt.Sprintf("192.0.2.%d", 100+i%100)
					first := serveRL(h, ip, nil)
					second := serveRL(h, ip, nil)
					if first.passed && first.header.Get(HeaderRateLimit) != "" && !second.passed && second.status == 429 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("no Redis decision 15s after Redis came back: %d/%d", first.status, second.status)
					}
					time.Sleep(100 * time.Millisecond)
				}
				if h.client.Batcher().BreakerOpen() {
					t.Fatal("breaker still open after recovery")
				}
			})
		}
	}
}

// TestRateLimitBatcherLogsThroughCurrentConfig: the batcher and breaker
// outlive a config reload; their log lines go to the logger of the handler
// whose call caused them, not to the first config's logger forever.
func TestRateLimitBatcherLogsThroughCurrentConfig(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	mk := func() (*RedisRateLimit, *observer.ObservedLogs) {
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Timeout = caddy.Duration(200 * time.Millisecond)
		})
		core, logs := observer.New(zapcore.InfoLevel)
		h.logger = zap.New(core)
		return h, logs
	}
	old, oldLogs := mk()
	if a := serveRL(old, "192.0.2.1", nil); !a.passed {
		t.Fatal("first decision failed")
	}
	cur, curLogs := mk() // the reloaded config, sharing the client
	if cur.client != old.client {
		t.Fatal("the reloaded handler does not share the client")
	}
	_ = old.Cleanup()
	r.Kill()
	for i := 0; i < ratelimit.BreakerThreshold+1; i++ {
		serveRL(cur, "192.0.2.2", nil)
	}
	if curLogs.FilterMessageSnippet("redis unreachable").Len() != 1 {
		t.Errorf("the current config's logger did not get the breaker's warning: %v", curLogs.All())
	}
	if n := oldLogs.FilterMessageSnippet("redis unreachable").Len(); n != 0 {
		t.Errorf("the old config's logger got %d breaker warnings after the reload", n)
	}
}

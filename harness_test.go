package redisdlm

import (
	"fmt"
	"sync"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
)

// handlerServer serves mw in front of next the way Caddy's server does;
// okHandler answers 200; get sends one GET with a bounded client
// (internal/testkit).
var (
	handlerServer = testkit.Serve
	okHandler     = testkit.OK
	get           = testkit.Get
)

// provisionLock builds a redis_lock handler from its JSON form, provisions
// it like Caddy would, and cleans it up when the test ends (it keeps the
// logger Caddy gives it: the root reaches the lock through its exported
// API only).
func provisionLock(t testing.TB, cfg string) *redislock.RedisLock {
	t.Helper()
	h := new(redislock.RedisLock)
	testkit.Provision(t, cfg, h)
	return h
}

// provisionLockScoped is provisionLock for an instance that lives for part
// of a test: the returned function cleans it up (once; it also runs when
// the test ends).
func provisionLockScoped(t *testing.T, cfg string) (*redislock.RedisLock, func()) {
	t.Helper()
	h := new(redislock.RedisLock)
	return h, provisionScoped(t, cfg, h)
}

// provisionScoped fills h from its JSON form and provisions it; the returned
// function cleans it up (once; it also runs when the test ends)
// (testkit.ProvisionScoped).
func provisionScoped(t *testing.T, cfg string, h testkit.Provisionable) func() {
	t.Helper()
	return testkit.ProvisionScoped(t, cfg, h)
}

// provisionRateLimitJSON does the same for a redis_ratelimit handler.
func provisionRateLimitJSON(t testing.TB, cfg string) *redisratelimit.RedisRateLimit {
	t.Helper()
	h := new(redisratelimit.RedisRateLimit)
	testkit.Provision(t, cfg, h)
	return h
}

// provisionRateLimitScoped is provisionRateLimitJSON for an instance that
// lives for part of a test (provisionScoped).
func provisionRateLimitScoped(t *testing.T, cfg string) (*redisratelimit.RedisRateLimit, func()) {
	t.Helper()
	h := new(redisratelimit.RedisRateLimit)
	return h, provisionScoped(t, cfg, h)
}

// rateLimitClient returns the pooled client of a provisioned redis_ratelimit
// handler (its one logical Redis).
func rateLimitClient(t *testing.T, h *redisratelimit.RedisRateLimit) *shared.Client {
	t.Helper()
	settings, err := h.RedisConfig.Resolve()
	if err != nil || len(settings) != 1 {
		t.Fatalf("the limiter's connection settings: %v %v", settings, err)
	}
	return testkit.PooledFor(t, settings[0].PoolKey())
}

// getAllOK sends n concurrent GETs, request i to urls[i%len(urls)] + path
// "/<name><i%keys>", and fails the test for any answer but 200.
func getAllOK(t *testing.T, n int, urls []string, name string, keys int) {
	t.Helper()
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if resp, body := get(t, fmt.Sprintf("%s/%s%d", urls[i%len(urls)], name, i%keys)); resp == nil || resp.StatusCode != 200 {
				t.Errorf("request %d: %v %s", i, resp, body)
			}
		}(i)
	}
	wg.Wait()
}

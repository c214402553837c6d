package redisdlm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
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
// function cleans it up (once; it also runs when the test ends).
func provisionScoped(t *testing.T, cfg string, h testkit.Provisionable) func() {
	t.Helper()
	if err := json.Unmarshal([]byte(cfg), h); err != nil {
		t.Fatalf("config %s: %v", cfg, err)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := h.Provision(ctx); err != nil {
		cancel()
		t.Fatalf("provision: %v", err)
	}
	var once sync.Once
	done := func() { once.Do(func() { _ = h.Cleanup(); cancel() }) }
	t.Cleanup(done)
	return done
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

// handlerServer serves mw in front of next the way Caddy's server does: a
// replacer and vars in the context, a HandlerError turned into its status.
func handlerServer(t testing.TB, mw caddyhttp.MiddlewareHandler, next caddyhttp.HandlerFunc) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The vars first, so that the replacer sees {http.vars.client_ip}
		// as Caddy's does.
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{"client_ip": strings.Split(r.RemoteAddr, ":")[0]}))
		repl := caddyhttp.NewTestReplacer(r)
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
		err := mw.ServeHTTP(w, r, next)
		if err != nil {
			var he caddyhttp.HandlerError
			status := http.StatusInternalServerError
			if errors.As(err, &he) {
				status = he.StatusCode
			}
			if status == testkit.StatusClientClosedRequest {
				return
			}
			w.WriteHeader(status)
			fmt.Fprint(w, err.Error())
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// okHandler answers 200.
func okHandler(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
}

// get sends one GET with a bounded client.
func get(t testing.TB, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Errorf("GET %s: %v", url, err)
		return nil, ""
	}
	defer resp.Body.Close()
	var sb strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		sb.Write(buf[:n])
		if err != nil {
			break
		}
	}
	return resp, sb.String()
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

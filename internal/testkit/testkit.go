// Package testkit is what the handler packages' tests (and the root's)
// share: a handler provisioned from its JSON form as Caddy would, a server
// that serves it the way Caddy's does, bounded waits and requests,
// TestMain's settings, and the upstreams and background requests of the
// lock's, replay's and the fence's tests (lock.go, replay.go, fence.go).
// It is imported by tests only.
package testkit

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Provisionable is a handler module a test builds.
type Provisionable interface {
	caddy.Provisioner
	caddy.CleanerUpper
}

// Provision fills h from its JSON form, provisions it as Caddy would (in
// a context of its own), and cleans it up when the test ends.
func Provision(t testing.TB, cfg string, h Provisionable) {
	t.Helper()
	if err := json.Unmarshal([]byte(cfg), h); err != nil {
		t.Fatalf("config %s: %v", cfg, err)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	t.Cleanup(func() { _ = h.Cleanup() })
}

// ProvisionScoped is Provision for a handler that lives for part of a
// test: the returned function cleans it up (once; it also runs when the
// test ends).
func ProvisionScoped(t testing.TB, cfg string, h Provisionable) func() {
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

// QuietLogger logs warnings and errors to stderr: what a test gives a
// handler instead of the debug logger Caddy gives a module provisioned
// without a config.
func QuietLogger() *zap.Logger {
	enc := zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig())
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(os.Stderr), zapcore.WarnLevel))
}

// StatusClientClosedRequest is what a handler answers (as an error) when
// the client went away: nothing is written then.
const StatusClientClosedRequest = 499

// Serve serves mw in front of next the way Caddy's server does: vars and a
// replacer in the context, a HandlerError turned into its status.
func Serve(t testing.TB, mw caddyhttp.MiddlewareHandler, next caddyhttp.HandlerFunc) *httptest.Server {
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
			if status == StatusClientClosedRequest {
				return
			}
			w.WriteHeader(status)
			fmt.Fprint(w, err.Error())
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// OK answers 200.
func OK(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
}

// WaitFor polls cond until it holds (true) or d passed (false)
// (testredis.WaitFor).
func WaitFor(d time.Duration, cond func() bool) bool { return testredis.WaitFor(d, cond) }

// Get sends one GET with headers (name, value pairs) through a bounded
// client; a failed request fails the test and returns nil.
func Get(t testing.TB, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Errorf("GET %s: %v", url, err)
		return nil, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// Main is a handler package's TestMain: more tests at once than
// -parallel's default (GOMAXPROCS), since most of them wait on Redis
// servers and timers, not on the CPU — eight, not more: with -race on two
// cores, sixteen at once pushed calls past their 500ms timeout now and
// then; an explicit -parallel wins — and a pooled client whose handlers
// went away closes 0.5 s later instead of Caddy's 10 s, so tests that
// watch it close need not wait.
func Main(m *testing.M) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "test.parallel" {
			set = true
		}
	})
	if !set {
		_ = flag.Set("test.parallel", "8")
	}
	shared.DestructGrace = 500 * time.Millisecond
	os.Exit(m.Run())
}

// Count is a counter's value now.
func Count(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// CheckRoundTrip checks what a Caddyfile parser accepted, the way Caddy
// uses it: its JSON form unmarshals into a fresh handler with the same JSON,
// and Provision of that either succeeds (Cleanup then releases what it took)
// or fails with an error that names the directive. Provision never dials.
// Configs naming files (TLS) are not provisioned: a fuzzed path could be a
// device that never ends.
func CheckRoundTrip(t *testing.T, dir string, parsed any, conn *shared.RedisConfig, fresh Provisionable) {
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

// CheckParseError fails unless a parse error names the directive.
func CheckParseError(t *testing.T, dir string, err error) {
	t.Helper()
	if err != nil && !strings.Contains(err.Error(), dir) {
		t.Fatalf("parse error does not name the directive %s: %v", dir, err)
	}
}

// SlidingUsed counts the admissions Redis's sliding log of key holds
// within the last w (Redis TIME): a redis_ratelimit sliding_window log, a
// 24-byte header and then 8-byte admission times in µs.
func SlidingUsed(t testing.TB, c *redis.Client, key string, w time.Duration) int {
	t.Helper()
	v, err := c.Get(t.Context(), key).Bytes()
	if err != nil || len(v) < 24 {
		return 0
	}
	now, err := c.Time(t.Context()).Result()
	if err != nil {
		t.Fatalf("redis TIME: %v", err)
	}
	n := 0
	for off := 24; off+8 <= len(v); off += 8 {
		at := int64(math.Float64frombits(binary.BigEndian.Uint64(v[off : off+8])))
		if at > 0 && at >= now.Add(-w).UnixMicro() {
			n++
		}
	}
	return n
}

// WholeCaddy serialises what runs the (process-global) Caddy: RunCaddy,
// and caddy.Validate of a whole config.
var WholeCaddy sync.Mutex

// SkipWholeCaddyIfShort skips whole-Caddy tests under -short.
func SkipWholeCaddyIfShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("whole-Caddy test: skipped under -short")
	}
}

// RunCaddy adapts a Caddyfile and runs it as the whole in-process Caddy
// (the modules linked into the test binary) until the test ends.
func RunCaddy(t testing.TB, caddyfile string) {
	t.Helper()
	SkipWholeCaddyIfShort(t)
	WholeCaddy.Lock()
	cfg, warns, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		WholeCaddy.Unlock()
		t.Fatalf("adapt: %v", err)
	}
	for _, w := range warns {
		t.Logf("adapt warning: %s", w.Message)
	}
	if err := caddy.Load(cfg, true); err != nil {
		WholeCaddy.Unlock()
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		_ = caddy.Stop()
		WholeCaddy.Unlock()
	})
}

// RetryAfters collects the Retry-After (whole seconds) of n requests to
// url, each of which must be answered wantStatus.
func RetryAfters(t testing.TB, url string, n int, wantStatus int) []int {
	t.Helper()
	var got []int
	for range n {
		resp, _ := Get(t, url)
		if resp == nil || resp.StatusCode != wantStatus {
			t.Fatalf("%v, want %d", resp, wantStatus)
		}
		v, err := strconv.Atoi(resp.Header.Get("Retry-After"))
		if err != nil {
			t.Fatalf("Retry-After %q: %v", resp.Header.Get("Retry-After"), err)
		}
		got = append(got, v)
	}
	return got
}

// CheckSpread fails the test unless every Retry-After in got is within
// [lo, hi] and they take at least three values (jittered).
func CheckSpread(t testing.TB, got []int, lo, hi int) {
	t.Helper()
	seen := map[int]bool{}
	for _, v := range got {
		if v < lo || v > hi {
			t.Fatalf("Retry-After %v, want each in [%d, %d]", got, lo, hi)
		}
		seen[v] = true
	}
	if len(seen) < 3 {
		t.Fatalf("Retry-After %v: %d distinct values, want them spread", got, len(seen))
	}
}

// AdminCall calls an admin API handler function f (the part of a route
// after its path is parsed) with a method and no body, and returns the
// status and body it answered: a caddy.APIError's status and message, or
// 200 and what it wrote. Another error fails the test.
func AdminCall(t testing.TB, method, key string, f func(w http.ResponseWriter, r *http.Request) error) (int, string) {
	t.Helper()
	w := httptest.NewRecorder()
	err := f(w, httptest.NewRequest(method, "/", nil))
	var ae caddy.APIError
	if errors.As(err, &ae) {
		return ae.HTTPStatus, ae.Message
	}
	if err != nil {
		t.Fatalf("%s %s: %v", method, key, err)
	}
	return 200, w.Body.String()
}

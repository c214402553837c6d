// Package testkit is what the handler packages' tests share: a handler
// provisioned from its JSON form as Caddy would, a server that serves it
// the way Caddy's does, bounded waits and requests, and TestMain's
// settings. It is imported by tests only.
package testkit

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
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

// WaitFor polls cond until it holds (true) or d passed (false).
func WaitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

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

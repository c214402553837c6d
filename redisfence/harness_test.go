package redisfence

import (
	"testing"
	"time"

	"net/http"
	"net/http/httptest"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestMain(m *testing.M) { testkit.Main(m) }

type testRedis = testredis.Server

func startRedis(t testing.TB, args ...string) *testRedis {
	t.Helper()
	return testredis.Start(t, args...)
}

func handlerServer(t testing.TB, mw caddyhttp.MiddlewareHandler, next caddyhttp.HandlerFunc) *httptest.Server {
	t.Helper()
	return testkit.Serve(t, mw, next)
}

func waitFor(d time.Duration, cond func() bool) bool { return testkit.WaitFor(d, cond) }

func get(t testing.TB, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	return testkit.Get(t, url, hdr...)
}

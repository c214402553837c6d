package redisratelimit

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// failLog is the first fail-policy warning's error text.
func failLog(t *testing.T, logs *observer.ObservedLogs) string {
	t.Helper()
	for _, e := range logs.FilterMessageSnippet("redis unavailable").All() {
		for _, f := range e.Context {
			if f.Key == "error" {
				if err, ok := f.Interface.(error); ok {
					return err.Error()
				}
			}
		}
	}
	t.Fatalf("no fail-policy warning with an error: %v", logs.All())
	return ""
}

// TestRateLimitErrorCauses: Redis failures are logged with their real
// cause (a refused connection as refused, a wrong password as an
// authentication error, an unknown TLS authority as such; not "unexpected
// script answer" or a timeout), answer at once, open the breaker, and
// follow the fail policy (503 with Retry-After with fail_closed). Once the
// breaker is open, requests make no new connections.
func TestRateLimitErrorCauses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// mk starts what the case needs and returns the handler's Redis
		// settings and a count of connections the server accepted.
		mk   func(t *testing.T) (func(h *RedisRateLimit), func() int64)
		want []string
		not  []string
	}{
		{"refused", func(t *testing.T) (func(h *RedisRateLimit), func() int64) {
			addr := "127.0.0.1:" + strconv.Itoa(freePort(t))
			return func(h *RedisRateLimit) { h.Addresses = []string{addr} }, nil
		}, []string{"refused"}, []string{"did not answer", "timeout"}},
		{"wrong password", func(t *testing.T) (func(h *RedisRateLimit), func() int64) {
			r := startRedis(t, "--requirepass", "right-pw")
			c := redis.NewClient(&redis.Options{Addr: r.Addr, Password: "right-pw"})
			t.Cleanup(func() { c.Close() })
			return func(h *RedisRateLimit) { h.Addresses, h.Password = []string{r.Addr}, "wrong-pw" },
				func() int64 { return infoStat(t, c, "total_connections_received") }
		}, []string{"WRONGPASS"}, []string{"unexpected script answer", "wrong-pw", "did not answer"}},
		{"tls unknown authority", func(t *testing.T) (func(h *RedisRateLimit), func() int64) {
			dir := t.TempDir()
			server := writeTestCA(t, dir, "server")
			other := writeTestCA(t, dir, "other") // did not sign the server's certificate
			port := freePort(t)
			startRedis(t, "--tls-port", strconv.Itoa(port), "--tls-cert-file", server+".crt", "--tls-key-file", server+".key",
				"--tls-ca-cert-file", server+".crt", "--tls-auth-clients", "no")
			return func(h *RedisRateLimit) {
				h.Addresses, h.TLS, h.TLSCAFile = []string{"127.0.0.1:" + strconv.Itoa(port)}, true, other+".crt"
				// A handshake under -race on a loaded machine can take
				// longer than the default 500ms: the refusal, not a
				// timeout, is what this case checks.
				h.Timeout = caddy.Duration(5 * time.Second)
			}, nil
		}, []string{"x509"}, []string{"did not answer", "timeout"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			conf, conns := tc.mk(t)
			core, logs := observer.New(zapcore.WarnLevel)
			h := newRateLimit(t, &testRedis{}, func(h *RedisRateLimit) {
				conf(h)
				h.FailClosed = true
				h.Timeout = caddy.Duration(shared.DefaultTimeout)
			})
			h.logger = zap.New(core)
			for i := 0; i < ratelimit.BreakerThreshold; i++ {
				a := serveRL(h, "192.0.2.90", nil)
				if a.status != http.StatusServiceUnavailable || a.retryAfter() != 1 {
					t.Fatalf("request %d: status %d Retry-After %q, want 503 with Retry-After 1", i, a.status, a.header.Get(HeaderRetryAfter))
				}
				if a.elapsed > time.Second {
					t.Fatalf("request %d took %s: a fast failure was made to wait", i, a.elapsed)
				}
			}
			if !h.client.Batcher().BreakerOpen() {
				t.Error("breaker not open after repeated failures")
			}
			var before int64
			if conns != nil {
				before = conns()
			}
			for i := 0; i < 20; i++ {
				if a := serveRL(h, "192.0.2.90", nil); a.status != http.StatusServiceUnavailable || a.retryAfter() != 1 {
					t.Fatalf("breaker open: status %d Retry-After %q", a.status, a.header.Get(HeaderRetryAfter))
				}
			}
			if conns != nil {
				// One probe a second may connect; 20 requests must not.
				if n := conns() - before - 1; n > 2 {
					t.Errorf("20 requests with the breaker open made %d connections", n)
				}
			}
			msg := failLog(t, logs)
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("logged cause %q lacks %q", msg, w)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(msg, w) {
					t.Errorf("logged cause %q contains %q", msg, w)
				}
			}
		})
	}
}

// infoStat reads one field of INFO stats.
func infoStat(t *testing.T, c *redis.Client, field string) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "stats").Result()
	if err != nil {
		t.Fatalf("info stats: %v", err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Fatalf("no %s in INFO stats", field)
	return 0
}

// writeTestCA writes a self-signed certificate for 127.0.0.1 (which is its
// own CA) and its key to dir/name.crt and dir/name.key, and returns
// dir/name.
func writeTestCA(t *testing.T, dir, name string) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(dir, name)
	if err := os.WriteFile(base+".crt", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(base+".key", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	return base
}

// TestRateLimitClientGoneIs499: a request whose client goes away while its
// decision waits for a paused Redis is answered 499 (as redis_lock does),
// not an error Caddy would log as 500.
func TestRateLimitClientGoneIs499(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := newRateLimit(t, r, func(h *RedisRateLimit) { h.Timeout = caddy.Duration(2 * time.Second) })
	if a := serveRL(h, "192.0.2.91", nil); !a.passed {
		t.Fatal("first request rejected")
	}
	r.Pause()
	defer r.Resume()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	a := serveRLWith(ctx, h, "192.0.2.91", nil, nil)
	if a.passed || a.status != statusClientClosedRequest {
		t.Fatalf("client gone during the decision: passed=%v status %d err %v, want 499", a.passed, a.status, a.err)
	}
}

// TestRateLimitResetWithinWindow: RateLimit's t never exceeds the window
// (the quota grows 1µs after an admission's window ends, which rounds up
// to w+1 whole seconds otherwise), admitted or rejected, both algorithms.
func TestRateLimitResetWithinWindow(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	for _, algo := range []string{algoSliding, algoGCRA} {
		h := newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Algorithm = algo
			h.Prefix = algo + ":"
			h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(10 * time.Second)}}
		})
		for i := 0; i < 5; i++ {
			a := serveRL(h, "192.0.2.92", nil)
			if _, _, secs := rlState(t, a); secs > 10 || secs < 1 {
				t.Fatalf("%s request %d (passed=%v): RateLimit %q: t must be within the 10s window", algo, i, a.passed, a.header.Get(HeaderRateLimit))
			}
		}
	}
}

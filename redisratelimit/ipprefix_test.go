package redisratelimit

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// from returns a client whose connections come from local address ip.
func from(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
	return &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DialContext: d.DialContext}}
}

// TestIPPrefix: with `ip_prefix 24 64`
// two client addresses in one /24 (127.0.0.1 and 127.0.0.2) share one
// bucket — as the default key, as {client_ip} in a template and as the
// fallback of a key that renders empty; without it each has its own. The
// grouping itself: IPv4-mapped IPv6 counts as IPv4, zones are dropped,
// what is no IP stays as it is; 0 bits is a config error.
func TestIPPrefix(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	a, b := from("127.0.0.1"), from("127.0.0.2")
	status := func(c *http.Client, url string) int {
		resp, err := c.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		name, extra string
		shared      bool
	}{
		{"default key, no prefix", ``, false},
		{"default key", `,"ip_prefix":[24,64]`, true},
		{"client_ip in a template", `,"ip_prefix":[24,64],"key":"ip:{client_ip}"`, true},
		{"fallback of an empty key", `,"ip_prefix":[24,64],"key":"{http.request.header.X-Missing}"`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":["%s"],"rates":[{"requests":2,"window":"1m"}],"prefix":"ipp:%s:"%s}`, r.Addr, strings.ReplaceAll(tc.name, " ", "-"), tc.extra))
			srv := handlerServer(t, h, okHandler)
			got := []int{status(a, srv.URL), status(b, srv.URL), status(a, srv.URL)}
			want := []int{200, 200, 200}
			if tc.shared {
				want = []int{200, 200, 429}
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("answers from .1, .2, .1: %v, want %v", got, want)
			}
		})
	}
	t.Run("grouping", func(t *testing.T) {
		p := shared.IPPrefix{V4: 24, V6: 64}
		for in, want := range map[string]string{
			"192.0.2.77":               "192.0.2.0/24",
			"::ffff:192.0.2.77":        "192.0.2.0/24",
			"2001:db8:1:2:3:4:5:6":     "2001:db8:1:2::/64",
			"fe80::1:2:3:4%eth0":       "fe80::/64",
			"not-an-ip":                "not-an-ip",
			"unix:/run/caddy.sock@abc": "unix:/run/caddy.sock@abc",
		} {
			if got := p.Group(in); got != want {
				t.Errorf("group(%q) = %q, want %q", in, got, want)
			}
		}
		if got := (shared.IPPrefix{}).Group("192.0.2.77"); got != "192.0.2.77" {
			t.Errorf("no prefix: %q", got)
		}
	})
	t.Run("config", func(t *testing.T) {
		for _, block := range []string{"ip_prefix 0 64", "ip_prefix 24 0", "ip_prefix 33 64", "ip_prefix 24", "ip_prefix a b"} {
			err := new(RedisRateLimit).UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_ratelimit {\n\trate 1 1s\n\t" + block + "\n}"))
			if err == nil || !strings.Contains(err.Error(), "ip_prefix") || !strings.Contains(err.Error(), ":3") {
				t.Errorf("%q: %v, want an ip_prefix error with the line", block, err)
			}
		}
		h := new(RedisRateLimit)
		h.Rates = []Rate{{Requests: 1, Window: 1e9}}
		h.IPPrefix = []int{0, 64}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "ip_prefix") {
			t.Errorf("JSON ip_prefix [0, 64]: %v", err)
		}
	})
}

package redisratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
)

// TestAdminQuotaOnCluster: the admin API's quota calls work on a Redis
// Cluster (every script's keys share one hash slot). (The lock calls:
// redislock's TestAdminOnCluster.)
func TestAdminQuotaOnCluster(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	call := func(method, key string, f func(w http.ResponseWriter, r *http.Request) error) (int, string) {
		return testkit.AdminCall(t, method, key, f)
	}
	ctx := t.Context()
	rl := newRateLimit(t, rs[0], func(h *RedisRateLimit) {
		h.Addresses, h.Cluster = nil, []string{rs[0].Addr, rs[1].Addr}
		h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(time.Minute)}, {Requests: 100, Window: caddy.Duration(time.Hour)}}
		h.Timeout = caddy.Duration(2 * time.Second)
	})
	for _, id := range []string{"u1", "u2", "u3"} {
		if _, err := rl.decide(ctx, id, &rl.static); err != nil {
			t.Fatal(err)
		}
		status, body := call("GET", id, func(w http.ResponseWriter, r *http.Request) error { return rl.inspectQuota(w, r, id) })
		if status != 200 || !strings.Contains(body, `"remaining": 2`) {
			t.Errorf("quota of %s on a cluster: %d %s", id, status, body)
		}
		status, body = call("DELETE", id, func(w http.ResponseWriter, r *http.Request) error {
			return rl.resetQuota(w, r, []*RedisRateLimit{rl}, id)
		})
		if status != 200 {
			t.Errorf("reset of %s on a cluster: %d %s", id, status, body)
		}
		if status, _ := call("GET", id, func(w http.ResponseWriter, r *http.Request) error { return rl.inspectQuota(w, r, id) }); status != 404 {
			t.Errorf("quota of %s after its reset: %d, want 404", id, status)
		}
	}
}

// TestAdminQuotaPlansOnCluster: the rendered rates of a key are found on
// the Cluster node of the key's slot, read and reset.
func TestAdminQuotaPlansOnCluster(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	rate, err := RateOf("{http.request.header.X-N}", "1m")
	if err != nil {
		t.Fatal(err)
	}
	rl := newRateLimit(t, rs[0], func(h *RedisRateLimit) {
		h.Addresses, h.Cluster = nil, []string{rs[0].Addr, rs[1].Addr}
		h.Rates = []Rate{rate}
		h.Timeout = caddy.Duration(2 * time.Second)
	})
	call := func(method, id string) (int, string) {
		return testkit.AdminCall(t, method, id, func(w http.ResponseWriter, r *http.Request) error {
			if method == "DELETE" {
				return rl.resetQuota(w, r, []*RedisRateLimit{rl}, id)
			}
			return rl.inspectQuota(w, r, id)
		})
	}
	for i, ip := range []string{"192.0.2.1", "192.0.2.2", "192.0.2.3"} {
		for _, n := range []string{"5", "7"} {
			for j := 0; j <= i; j++ {
				if a := serveRL(rl, ip, func(r *http.Request, _ *caddy.Replacer) { r.Header.Set("X-N", n) }); !a.passed {
					t.Fatalf("%s n=%s request %d: %d %v", ip, n, j, a.status, a.err)
				}
			}
		}
		id := ip // the default key: the client IP
		status, body := call("GET", id)
		want := fmt.Sprintf(`"used": %d`, i+1)
		if status != 200 || strings.Count(body, want) != 2 || !strings.Contains(body, `"requests": 5`) || !strings.Contains(body, `"requests": 7`) {
			t.Errorf("GET %s on a cluster: %d %s; want both plans used %d", id, status, body, i+1)
		}
		if status, body := call("DELETE", id); status != 200 || strings.Count(body, ":sw:") != 2 {
			t.Errorf("DELETE %s on a cluster: %d %s", id, status, body)
		}
		if status, body := call("GET", id); status != 404 {
			t.Errorf("GET %s after its reset: %d %s, want 404", id, status, body)
		}
	}
}

// TestAdminQuotaPlansIndex: a limit with placeholder rates is read
// and reset without a keyspace scan: the decision script keeps each key's
// index of the rendered rates it has state for (`<prefix>{<key>}:rates`),
// expiring with its longest window. GET and DELETE call no SCAN; a rate
// whose state expired is no longer listed; the index expires with the last
// state; DELETE removes the index with the states. A fixed-rate handler
// writes no index.
func TestAdminQuotaPlansIndex(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	rate, err := RateOf("{http.request.header.X-N}", "{http.request.header.X-W}")
	if err != nil {
		t.Fatal(err)
	}
	rl := newRateLimit(t, r, func(h *RedisRateLimit) { h.Rates = []Rate{rate} })
	fixed := newRateLimit(t, r, func(h *RedisRateLimit) { h.Prefix = "fixed:" })
	c := r.Client()
	ctx := context.Background()
	call := func(method, id string) (int, quotaAnswer) {
		w := httptest.NewRecorder()
		req := httptest.NewRequest(method, "/", nil)
		var err error
		if method == "DELETE" {
			err = rl.resetQuota(w, req, []*RedisRateLimit{rl}, id)
		} else {
			err = rl.inspectQuota(w, req, id)
		}
		var ae caddy.APIError
		if errors.As(err, &ae) {
			return ae.HTTPStatus, quotaAnswer{}
		}
		if err != nil {
			t.Fatalf("%s %s: %v", method, id, err)
		}
		var q quotaAnswer
		if err := json.Unmarshal(w.Body.Bytes(), &q); err != nil {
			t.Fatalf("%s %s: %v in %s", method, id, err, w.Body.String())
		}
		return 200, q
	}
	plan := func(ip, n, w string) {
		t.Helper()
		if a := serveRL(rl, ip, func(r *http.Request, _ *caddy.Replacer) { r.Header.Set("X-N", n); r.Header.Set("X-W", w) }); !a.passed {
			t.Fatalf("%s %s/%s: %d %v", ip, n, w, a.status, a.err)
		}
	}
	scans := func() int64 {
		info, err := c.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(line, "cmdstat_scan:calls="); ok {
				n, _ := strconv.ParseInt(v[:strings.IndexByte(v, ',')], 10, 64)
				return n
			}
		}
		return 0
	}
	if a := serveRL(fixed, "192.0.2.40", nil); !a.passed {
		t.Fatalf("fixed rate: %d %v", a.status, a.err)
	}
	if n, _ := c.Exists(ctx, "fixed:{192.0.2.40}:rates").Result(); n != 0 {
		t.Error("a fixed-rate handler wrote a rate index")
	}

	const ip = "192.0.2.41"
	index := DefaultRateLimitPrefix + "{" + ip + "}:rates"
	plan(ip, "5", "1s")
	plan(ip, "7", "4s")
	plan(ip, "7", "4s")
	before := scans()
	status, q := call("GET", ip)
	if status != 200 || len(q.RedisKeys) != 2 || len(q.Rates) != 2 {
		t.Fatalf("GET: %d %+v, want both rendered rates", status, q)
	}
	for _, v := range q.Rates {
		if want := map[int64]int64{5: 1, 7: 2}[v.Requests]; v.Used != want {
			t.Errorf("rate %+v: used %d, want %d", v, v.Used, want)
		}
	}
	ttl := c.PTTL(ctx, index).Val()
	for _, k := range q.RedisKeys {
		if st := c.PTTL(ctx, k).Val(); st <= 0 || st > ttl {
			t.Errorf("state %s expires in %s, the index in %s: want the index last", k, st, ttl)
		}
	}
	if ttl <= 3*time.Second || ttl > 4100*time.Millisecond {
		t.Errorf("index PTTL %s, want the longest window (4s)", ttl)
	}
	// The 1s state expires: the index still lists it, GET no longer does.
	if !waitFor(5*time.Second, func() bool { return c.Exists(ctx, q.RedisKeys[0], q.RedisKeys[1]).Val() == 1 }) {
		t.Fatal("the 1s state did not expire")
	}
	if status, q := call("GET", ip); status != 200 || len(q.Rates) != 1 || q.Rates[0].Requests != 7 {
		t.Errorf("GET after the 1s state expired: %d %+v, want the 7/4s rate only", status, q)
	}
	// The index expires with the last state.
	if !waitFor(8*time.Second, func() bool { return c.Exists(ctx, index).Val() == 0 }) {
		t.Fatalf("index still there (PTTL %s)", c.PTTL(ctx, index).Val())
	}
	if n := c.Exists(ctx, q.RedisKeys...).Val(); n != 0 {
		t.Errorf("%d states outlived their index", n)
	}
	if status, _ := call("GET", ip); status != 404 {
		t.Errorf("GET once everything expired: %d, want 404", status)
	}

	// DELETE removes the states and the index.
	plan(ip, "5", "1m")
	plan(ip, "7", "1m")
	if status, q := call("DELETE", ip); status != 200 || len(q.RedisKeys) != 2 || !q.Reset {
		t.Fatalf("DELETE: %d %+v", status, q)
	}
	if keys := c.Keys(ctx, "*{"+ip+"}*").Val(); len(keys) != 0 {
		t.Errorf("left after DELETE: %v", keys)
	}
	if status, _ := call("GET", ip); status != 404 {
		t.Errorf("GET after DELETE: %d, want 404", status)
	}
	if got := scans(); got != before {
		t.Errorf("SCAN called %d times over GET and DELETE, want none", got-before)
	}
}

package redisdlm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// TestAdminQuotaPlans: a limit whose rate comes from `map` (a plan) is
// inspected and reset through the admin API: GET lists every rendered rate
// the key has state for (two plans used by one key), with its count;
// DELETE resets them all, and the next request is admitted on both
// instances (two sites with clients of their own on one Redis) within a
// second, also on the one whose deny cache held the key's rejection.
func TestAdminQuotaPlans(t *testing.T) {
	skipWholeCaddyIfShort(t)
	r := startRedis(t)
	portA, portB, admin := freePort(t), freePort(t), freePort(t)
	site := func(port int, name, timeout string) string {
		return fmt.Sprintf(`:%d {
	map {http.request.header.X-Plan} {plan_rpm} {
		pro 3
		default 2
	}
	redis_ratelimit {
		name %s
		key {http.request.header.X-User}
		rate {plan_rpm} 1m
		redis %s
		timeout %s
	}
	respond ok
}
`, port, name, r.Addr, timeout)
	}
	runCaddy(t, fmt.Sprintf("{\n\tadmin localhost:%d\n\tauto_https off\n}\n", admin)+site(portA, "plan_a", "3s")+site(portB, "plan_b", "4s"))
	callA := caller(t, fmt.Sprintf("http://127.0.0.1:%d", portA))
	callB := caller(t, fmt.Sprintf("http://127.0.0.1:%d", portB))
	const user = "adm1"
	plans := []struct {
		plan string
		n    int
	}{{"pro", 3}, {"free", 2}}
	for _, p := range plans {
		for i := 0; i < p.n; i++ {
			call := callA
			if i%2 == 1 {
				call = callB
			}
			if resp := call("/", "X-User", user, "X-Plan", p.plan); resp.StatusCode != 200 {
				t.Fatalf("%s request %d: %d", p.plan, i+1, resp.StatusCode)
			}
		}
		// Both instances learn the rejection (their deny caches hold it).
		for _, call := range []func(string, ...string) *http.Response{callA, callB} {
			if resp := call("/", "X-User", user, "X-Plan", p.plan); resp.StatusCode != 429 {
				t.Fatalf("%s request %d: %d, want 429", p.plan, p.n+1, resp.StatusCode)
			}
		}
	}

	quota := fmt.Sprintf("http://localhost:%d/redisdlm/limits/plan_a/%s", admin, url.PathEscape(user))
	for i := 0; i < 2; i++ { // reading counts nothing
		status, m, body := adminCall(t, "GET", quota)
		if status != 200 {
			t.Fatalf("GET: %d %s", status, body)
		}
		rates, _ := m["rates"].([]any)
		got := map[float64]float64{}
		for _, v := range rates {
			q := v.(map[string]any)
			if q["template"] != "{plan_rpm} 1m0s" || q["policy"] != "r0" || q["window"] != "1m0s" {
				t.Errorf("rate %v: want policy r0, window 1m0s and the rate's template", q)
			}
			n, _ := q["requests"].(float64)
			used, _ := q["used"].(float64)
			got[n] = used
			if rem, _ := q["remaining"].(float64); rem != 0 {
				t.Errorf("rate %v: remaining %v, want 0", q, rem)
			}
		}
		if len(rates) != 2 || got[3] != 3 || got[2] != 2 {
			t.Fatalf("GET %d: %s; want the pro rate (3) used 3 and the free rate (2) used 2", i, body)
		}
		if keys, _ := m["redis_keys"].([]any); len(keys) != 2 || m["complete"] != true {
			t.Errorf("GET: redis_keys %v complete %v, want 2 keys and a complete search", m["redis_keys"], m["complete"])
		}
	}

	status, m, body := adminCall(t, "DELETE", quota)
	lifted := time.Now()
	if status != 200 || m["reset"] != true {
		t.Fatalf("DELETE: %d %s", status, body)
	}
	if keys, _ := m["redis_keys"].([]any); len(keys) != 2 {
		t.Errorf("DELETE reset %v, want both plans' keys", m["redis_keys"])
	}
	if status, _, body := adminCall(t, "GET", quota); status != 404 {
		t.Errorf("GET after the reset: %d %s, want 404", status, body)
	}
	// The next request passes on both plans and both instances within a
	// second: on B too, whose deny cache held the rejections (the reset
	// reaches it through Pub/Sub).
	for _, p := range plans {
		for _, in := range []struct {
			name string
			call func(string, ...string) *http.Response
		}{{"B", callB}, {"A", callA}} {
			for in.call("/", "X-User", user, "X-Plan", p.plan).StatusCode != 200 {
				if time.Since(lifted) > time.Second {
					t.Fatalf("%s on instance %s: still rejected %s after the reset", p.plan, in.name, time.Since(lifted))
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
	if status, _, body := adminCall(t, "GET", quota); status != 200 {
		t.Errorf("GET after the reset and a request of each plan: %d %s, want 200", status, body)
	}

	// Nothing the reset wrote is left in Redis forever.
	c := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer c.Close()
	keys, err := c.Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if ttl := c.PTTL(context.Background(), k).Val(); ttl < 0 {
			t.Errorf("key %q has no expiry (%s)", k, ttl)
		}
	}
	if strings.Contains(strings.Join(keys, " "), "{~fleet}:resets") {
		t.Errorf("a reset notice in Redis (resets reach the fleet through Pub/Sub only): %v", keys)
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
		w := httptest.NewRecorder()
		f := func(w http.ResponseWriter, r *http.Request, h *RedisRateLimit, key string) error {
			return h.inspectQuota(w, r, key)
		}
		if method == "DELETE" {
			f = func(w http.ResponseWriter, r *http.Request, h *RedisRateLimit, key string) error {
				return h.resetQuota(w, r, []*RedisRateLimit{h}, key)
			}
		}
		err := f(w, httptest.NewRequest(method, "/", nil), rl, id)
		var ae caddy.APIError
		if errors.As(err, &ae) {
			return ae.HTTPStatus, ae.Message
		}
		if err != nil {
			t.Fatalf("%s %s: %v", method, id, err)
		}
		return 200, w.Body.String()
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
	index := rl.indexKey(ip)
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

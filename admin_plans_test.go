package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/redis/go-redis/v9"
)

// TestAdminQuotaPlans: a limit whose rate comes from `map` (a plan) is
// inspected and reset through the admin API: GET lists every rendered rate
// the key has state for (two plans used by one key), with its count;
// DELETE resets them all, and the next request is admitted on both
// instances (two sites with clients of their own on one Redis) within a
// second, also on the one whose deny cache held the key's rejection.
func TestAdminQuotaPlans(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
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
	testkit.RunCaddy(t, fmt.Sprintf("{\n\tadmin localhost:%d\n\tauto_https off\n}\n", admin)+site(portA, "plan_a", "3s")+site(portB, "plan_b", "4s"))
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
		if ttl := c.PTTL(context.Background(), k).Val(); ttl == -1 { // -2: expired since KEYS
			t.Errorf("key %q has no expiry (%s)", k, ttl)
		}
	}
	if strings.Contains(strings.Join(keys, " "), "{~fleet}:resets") {
		t.Errorf("a reset notice in Redis (resets reach the fleet through Pub/Sub only): %v", keys)
	}
}

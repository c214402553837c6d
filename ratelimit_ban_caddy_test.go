package redisdlm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
)

// banStatus sends one request for user to url and returns its status and
// Retry-After (-1 without one).
func banStatus(t *testing.T, url, user string) (int, int) {
	t.Helper()
	resp, _ := get(t, url, "X-User", user)
	if resp == nil {
		t.Fatalf("GET %s as %s: no answer", url, user)
	}
	ra := -1
	if v := resp.Header.Get(redisratelimit.HeaderRetryAfter); v != "" {
		ra, _ = strconv.Atoi(v)
	}
	return resp.StatusCode, ra
}

// banMetric reads caddy_redis_ratelimit_requests_total{result="banned"},
// summed over handlers, from the admin /metrics.
func banMetric(t *testing.T, admin int) int {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://localhost:%d/metrics", admin))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0
	for _, m := range regexp.MustCompile(`(?m)^caddy_redis_ratelimit_requests_total\{[^}]*result="banned"[^}]*\} (\d+)`).FindAllStringSubmatch(string(b), -1) {
		n, _ := strconv.Atoi(m[1])
		sum += n
	}
	return sum
}

// TestWholeCaddyRateLimitBan: two sites stand for two
// instances (each its own Redis client, batcher, deny cache and reset
// listener) sharing one Redis and one prefix. A key its quota rejects on one
// is banned on both, for the ban's duration, with Retry-After at the ban's
// end (the other instance learns it from Redis, then answers it from
// memory); other keys pass; once the ban ends the key is admitted again.
// The ban starts one rate_limit_banned event and counts its refusals as
// result="banned". The admin API shows banned_until, and its DELETE lifts
// the ban on both instances within a second (the other's deny cache
// forgets it through Pub/Sub).
func TestWholeCaddyRateLimitBan(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	mark := sinkMark()
	r := startRedis(t)
	portA, portB, admin := freePort(t), freePort(t), freePort(t)
	site := func(port int, name, timeout string) string {
		return fmt.Sprintf(`:%d {
	redis_ratelimit {
		name %s
		key {http.request.header.X-User}
		rate 2 3s
		ban 6s
		redis %s
		timeout %s
	}
	respond "ok"
}
`, port, name, r.Addr, timeout)
	}
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	metrics
	auto_https off
	events {
		on rate_limit_banned redisdlm_test_sink
	}
}
`, admin)+site(portA, "ban_a", "5s")+site(portB, "ban_b", "4s"))
	a, b := fmt.Sprintf("http://127.0.0.1:%d/", portA), fmt.Sprintf("http://127.0.0.1:%d/", portB)
	bannedBefore := banMetric(t, admin)

	// mallory spends her quota on A; the third request starts the ban.
	for i := 0; i < 2; i++ {
		if st, _ := banStatus(t, a, "mallory"); st != 200 {
			t.Fatalf("request %d within the quota: %d", i, st)
		}
	}
	started := time.Now()
	if st, ra := banStatus(t, a, "mallory"); st != 429 || ra < 5 || ra > 6 {
		t.Fatalf("the request that starts the ban: %d Retry-After %d, want 429 with 6 (the ban's end)", st, ra)
	}
	// Banned on both, outright, with Retry-After at the ban's end; B learns
	// it from Redis first, then from its deny cache.
	for i := 0; i < 3; i++ {
		for _, url := range []string{a, b} {
			st, ra := banStatus(t, url, "mallory")
			left := 6 - time.Since(started).Seconds()
			if st != 429 || float64(ra) < left-1 || ra > 6 {
				t.Fatalf("banned request %d to %s: %d Retry-After %d, want 429 with about %.1f", i, url, st, ra, left)
			}
		}
	}
	if st, _ := banStatus(t, b, "alice"); st != 200 {
		t.Fatalf("another key during mallory's ban: %d, want 200", st)
	}
	if got := banMetric(t, admin) - bannedBefore; got < 6 {
		t.Fatalf("result=banned counted %d refusals, want at least the 6 banned requests", got)
	}
	ev := 0
	for _, e := range eventsNamed(mark, shared.EventRateLimitBanned) {
		if e.Data["key"] == "mallory" {
			ev++
			if e.Data["handler"] != "ban_a" || !strings.Contains(fmt.Sprint(e.Data["reason"]), "r0") {
				t.Errorf("rate_limit_banned data %v, want handler ban_a and the rate r0", e.Data)
			}
		}
	}
	if ev != 1 {
		t.Fatalf("%d rate_limit_banned events for mallory, want 1 (when the ban starts)", ev)
	}

	// The admin API shows the ban, and lifts it on both within a second.
	for i := 0; i < 3; i++ {
		banStatus(t, b, "eve")
	}
	if st, _ := banStatus(t, a, "eve"); st != 429 {
		t.Fatalf("eve after her quota on B: %d, want 429 (banned)", st)
	}
	limit := fmt.Sprintf("http://localhost:%d/redisdlm/limits/ban_a/eve", admin)
	resp, err := http.Get(limit)
	if err != nil {
		t.Fatal(err)
	}
	var q struct {
		BannedUntil string `json:"banned_until"`
		BanLeftMs   int64  `json:"ban_left_ms"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&q)
	resp.Body.Close()
	until, err := time.Parse(time.RFC3339Nano, q.BannedUntil)
	if err != nil || q.BanLeftMs <= 0 || q.BanLeftMs > 6000 || time.Until(until) > 7*time.Second {
		t.Fatalf("GET of a banned key: %+v (%v), want banned_until within 6s", q, err)
	}
	req, _ := http.NewRequest(http.MethodDelete, limit, nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
		t.Fatalf("DELETE: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	lifted := time.Now()
	for _, url := range []string{b, a} {
		for {
			st, _ := banStatus(t, url, "eve")
			if st == 200 {
				break
			}
			if time.Since(lifted) > time.Second {
				t.Fatalf("%s still rejects eve %s after the ban was lifted: %d", url, time.Since(lifted), st)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// The ban ends: mallory passes again, on both (her quota's window is
	// over too).
	time.Sleep(time.Until(started.Add(6500 * time.Millisecond)))
	for _, url := range []string{b, a} {
		if st, _ := banStatus(t, url, "mallory"); st != 200 {
			t.Fatalf("mallory after her ban ended, on %s: %d, want 200", url, st)
		}
	}
}

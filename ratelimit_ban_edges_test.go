package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
)

// A ban at the edges: three Caddy processes share one redis-server; a ban started through one is announced to all,
// and each holds it until it ends, through an outage, a Redis restarted
// empty and a Pub/Sub reconnect.

// banQuota is the fleet's quota per 3s: enough that each of the three
// instances may admit a key once in a window.
const banQuota = 3

// banFleet is three Caddy processes with one redis_ratelimit handler
// (`rate 3 3s`, a ban, policy) on one Redis.
type banFleet struct {
	r     *testRedis
	procs []*caddyProcess
	admin []int
}

// startBanFleet starts the three instances and returns once each one's
// reset listener is subscribed (a first request starts it).
func startBanFleet(t *testing.T, r *testRedis, ban time.Duration, policy string) *banFleet {
	t.Helper()
	f := &banFleet{r: r}
	for _, name := range []string{"A", "B", "C"} {
		port, admin := freePort(t), freePort(t)
		f.admin = append(f.admin, admin)
		f.procs = append(f.procs, startCaddyProcess(t, name, port, func(dir string) string {
			return fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
	persist_config off
	storage file_system %s
	log {
		level DEBUG
	}
}
http://127.0.0.1:%d {
	redis_ratelimit {
		name bans
		key {http.request.header.X-User}
		rate %d 3s
		ban %s
		%s
		redis %s
		timeout 500ms
	}
	respond "ok"
}
`, admin, dir, port, banQuota, ban, policy, r.Addr)
		}))
	}
	for _, p := range f.procs {
		if st, _ := banStatus(t, p.url(), "warm-up"); st != 200 {
			t.Fatalf("first request to %s: %d, want 200", p.name, st)
		}
	}
	rc := r.Client()
	if !waitFor(30*time.Second, func() bool {
		n, err := rc.PubSubNumSub(context.Background(), ratelimit.ForgetChannel).Result()
		return err == nil && n[ratelimit.ForgetChannel] == 3
	}) {
		t.Fatal("the three instances' reset listeners did not subscribe within 30s")
	}
	return f
}

// banVia spends user's quota through p and starts the ban; it returns
// when the ban started (at the latest).
func banVia(t *testing.T, p *caddyProcess, user string, ban time.Duration) time.Time {
	t.Helper()
	for i := 0; i < banQuota; i++ {
		if st, _ := banStatus(t, p.url(), user); st != 200 {
			t.Fatalf("%s request %d within the quota through %s: %d, want 200", user, i, p.name, st)
		}
	}
	started := time.Now()
	if st, ra := banStatus(t, p.url(), user); st != 429 || ra != int(ban/time.Second) {
		t.Fatalf("the request of %s that starts the ban through %s: %d Retry-After %d, want 429 with %d (the ban's end)", user, p.name, st, ra, int(ban/time.Second))
	}
	return started
}

// waitHeard waits (at most 3s in all) until each of procs has logged (at
// debug level) that it holds the ban of user announced through Pub/Sub:
// the announcement travels for a moment after the ban started. Not fatal:
// without it the test goes on to what the instances answer.
func waitHeard(t *testing.T, user string, procs ...*caddyProcess) {
	t.Helper()
	heard := func(p *caddyProcess) bool {
		b, _ := os.ReadFile(p.log)
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, `"msg":"ban announced: held until it ends"`) && strings.Contains(line, `"key":"`+user+`"`) {
				return true
			}
		}
		return false
	}
	waitFor(3*time.Second, func() bool {
		for _, p := range procs {
			if !heard(p) {
				return false
			}
		}
		return true
	})
	for _, p := range procs {
		if !heard(p) {
			t.Errorf("%s never logged that it holds the ban of %s announced through Pub/Sub", p.name, user)
		}
	}
}

// expectBanned asks every instance for user every 250ms until upto into
// the ban (started at started), and fails on any answer but 429 with the
// ban's Retry-After. each runs after every round.
func (f *banFleet) expectBanned(t *testing.T, user string, started time.Time, ban, upto time.Duration, each func()) {
	t.Helper()
	rounds := 0
	for time.Since(started) < upto {
		for _, p := range f.procs {
			st, ra := banStatus(t, p.url(), user)
			left := (ban - time.Since(started)).Seconds()
			if st != 429 || float64(ra) < left-1 || float64(ra) > left+1.5 {
				t.Fatalf("%s, %.1fs into its %s ban, on %s: %d Retry-After %d, want 429 with about %.1f (the ban's end)",
					user, time.Since(started).Seconds(), ban, p.name, st, ra, left)
			}
		}
		if each != nil {
			each()
		}
		rounds++
		time.Sleep(250 * time.Millisecond)
	}
	if rounds < 3 {
		t.Fatalf("only %d rounds of requests within the ban: the machine is too slow for this test's ban", rounds)
	}
}

// expectAdmitted waits (at most d) until every instance admits user.
func (f *banFleet) expectAdmitted(t *testing.T, user string, d time.Duration, why string) {
	t.Helper()
	for _, p := range f.procs {
		last := 0
		if !waitFor(d, func() bool { last, _ = banStatus(t, p.url(), user); return last == 200 }) {
			t.Fatalf("%s on %s %s: %d, want 200 within %s", user, p.name, why, last, d)
		}
	}
}

// TestWholeCaddyBanHoldsThroughOutage: carol is banned
// through A, then Redis is paused (SIGSTOP). B and C never asked Redis
// about carol, yet answer her 429 with the ban's Retry-After until the ban
// ends, never 200 — with fail_local and with the default policy (admit when
// Redis is unreachable) alike: the ban was announced to every instance as
// it started. Once it ends, the fail policy answers again (200).
func TestWholeCaddyBanHoldsThroughOutage(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	for _, policy := range []string{"fail_local\n\t\tinstances 3", ""} {
		name := "fail_local"
		if policy == "" {
			name = "fail_open"
		}
		t.Run(name, func(t *testing.T) {
			const ban = 8 * time.Second
			r := startRedis(t)
			f := startBanFleet(t, r, ban, policy)
			started := banVia(t, f.procs[0], "carol", ban)
			waitHeard(t, "carol", f.procs[1:]...)
			r.Pause()
			defer r.Resume()
			f.expectBanned(t, "carol", started, ban, ban-700*time.Millisecond, nil)
			f.expectAdmitted(t, "carol", 10*time.Second, "after the ban ended, Redis still paused")
		})
	}
}

// TestWholeCaddyBanHoldsThroughEmptyRestart: carol is banned
// through A, then Redis is killed (SIGKILL) and started again empty on its
// port. No instance admits carol until the ban ends (their listeners
// subscribe again to a new process and keep the ban), and the ban key is
// back in Redis with about the ban's remaining lifetime (written back), so
// the new process enforces it for every instance, also one that never
// heard of it. Once the ban ends, carol passes.
func TestWholeCaddyBanHoldsThroughEmptyRestart(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	const ban = 12 * time.Second
	r := startRedis(t)
	f := startBanFleet(t, r, ban, "")
	started := banVia(t, f.procs[0], "carol", ban)
	// B and C answer carol from their deny caches before the restart too.
	for _, p := range f.procs[1:] {
		if st, _ := banStatus(t, p.url(), "carol"); st != 429 {
			t.Fatalf("carol on %s before the restart: %d, want 429", p.name, st)
		}
	}
	r.Restart()
	rc := r.Client()
	key := redisratelimit.DefaultRateLimitPrefix + "{carol}:ban"
	var back time.Duration // the ban key's lifetime when first seen back
	var backAt time.Duration
	f.expectBanned(t, "carol", started, ban, ban-700*time.Millisecond, func() {
		if back > 0 {
			return
		}
		if ttl, err := rc.PTTL(context.Background(), key).Result(); err == nil && ttl > 0 {
			back, backAt = ttl, time.Since(started)
		}
	})
	if back == 0 {
		t.Fatalf("the ban key %s never came back to the restarted Redis within the ban", key)
	}
	if left := ban - backAt; back > left+200*time.Millisecond || back < left-2*time.Second {
		t.Fatalf("the ban key came back %.1fs into the ban with %s to live, want about %s (what was left of the ban)", backAt.Seconds(), back, left)
	}
	f.expectAdmitted(t, "carol", 10*time.Second, "after the ban ended")
}

// TestWholeCaddyBanLiftMissedOnReconnect: carol and mallory are banned
// through A, and B and C have each answered both from Redis. B and C are
// paused (SIGSTOP) while the Pub/Sub connections are cut (CLIENT KILL TYPE
// pubsub) and carol's ban is lifted through A's admin API, so B and C miss
// the lift. Resumed, they subscribe again to the same Redis process: carol's
// next request there is checked with Redis and admitted; mallory's ban is
// kept, and holds when Redis is paused then (her check with Redis fails),
// until it ends.
func TestWholeCaddyBanLiftMissedOnReconnect(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	const ban = 25 * time.Second
	r := startRedis(t)
	f := startBanFleet(t, r, ban, "")
	banVia(t, f.procs[0], "carol", ban)
	started := banVia(t, f.procs[0], "mallory", ban)
	for _, p := range f.procs[1:] {
		for _, user := range []string{"carol", "mallory"} {
			if st, _ := banStatus(t, p.url(), user); st != 429 {
				t.Fatalf("%s on %s: %d, want 429 (banned)", user, p.name, st)
			}
		}
	}

	for _, p := range f.procs[1:] {
		p.signal(t, syscall.SIGSTOP)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			for _, p := range f.procs[1:] {
				p.signal(t, syscall.SIGCONT)
			}
		}
	}
	defer resume()
	rc := r.Client()
	if err := rc.Do(context.Background(), "client", "kill", "type", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodDelete, fmt.Sprintf("http://localhost:%d/redisdlm/limits/bans/carol", f.admin[0]), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("DELETE of carol's limit: %v %v, want 200", resp, err)
	}
	resp.Body.Close()
	resume()

	f.expectAdmitted(t, "carol", 10*time.Second, "after her ban was lifted while the instance was cut off")
	r.Pause()
	defer r.Resume()
	f.expectBanned(t, "mallory", started, ban, time.Since(started)+4*time.Second, nil)
}

package redisdlm

import (
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"golang.org/x/crypto/bcrypt"
)

// TestWholeCaddyRateLimit runs the whole Caddy with redis_ratelimit from a
// Caddyfile: per authenticated user behind basic_auth (ordered before it
// by the plugin), and per header with two rates in front of redis_lock and
// reverse_proxy. It checks that users have independent limits, that a
// rejected request gets 429 with Retry-After and the RateLimit fields, that
// the lock still serialises the admitted requests (and a rejected one never
// reaches the lock), and that the admin /metrics counts denials without
// naming any user.
func TestWholeCaddyRateLimit(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)

	// A `caddy hash-password`-style bcrypt hash (minimum cost, for speed).
	const password = "s3cret-pw"
	hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	users := []string{"alice-zq7", "bob-zq7"}

	// The upstream of the second site records, per user, how many
	// requests are inside at once and the fencing tokens it gets.
	var mu sync.Mutex
	inflight, maxIn := map[string]int{}, map[string]int{}
	tokens := map[string][]int64{}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		user := req.Header.Get("X-User-ID")
		tok, _ := strconv.ParseInt(req.Header.Get("Lock-Fencing-Token"), 10, 64)
		mu.Lock()
		inflight[user]++
		if inflight[user] > maxIn[user] {
			maxIn[user] = inflight[user]
		}
		tokens[user] = append(tokens[user], tok)
		mu.Unlock()
		time.Sleep(60 * time.Millisecond)
		mu.Lock()
		inflight[user]--
		mu.Unlock()
		fmt.Fprintf(w, "upstream %s", user)
	}))
	defer up.Close()

	authPort, hdrPort, admin := freePort(t), freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	metrics
	auto_https off
}
:%d {
	basic_auth {
		%s %s
		%s %s
	}
	redis_ratelimit {
		key {http.auth.user.id}
		rate 3 1m
		redis %s
	}
	respond "hello {http.auth.user.id}"
}
:%d {
	redis_ratelimit {
		key {http.request.header.X-User-ID}
		rate 2 1m
		rate 100 1h
		redis %s
	}
	redis_lock {
		key {http.request.header.X-User-ID}
		redis %s
	}
	reverse_proxy %s
}
`, admin, authPort, users[0], hash, users[1], hash, r.Addr, hdrPort, r.Addr, r.Addr, strings.TrimPrefix(up.URL, "http://")))

	authURL := fmt.Sprintf("http://127.0.0.1:%d/", authPort)
	basic := func(user string) string {
		return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	}
	denied := 0

	// Site 1: per authenticated user, 3 per minute each, all from one IP.
	if resp, _ := get(t, authURL); resp == nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("no credentials: %v, want 401 from basic_auth", resp)
	}
	for _, user := range users {
		for i := 0; i < 3; i++ {
			resp, body := get(t, authURL, "Authorization", basic(user))
			if resp == nil {
				t.FailNow()
			}
			if resp.StatusCode != 200 || body != "hello "+user {
				t.Fatalf("%s request %d: %d %q, want 200 (users have separate limits)", user, i+1, resp.StatusCode, body)
			}
			if got, want := resp.Header.Get("RateLimit-Policy"), `"r0";q=3;w=60`; got != want {
				t.Errorf("%s request %d: RateLimit-Policy %q, want %q", user, i+1, got, want)
			}
			if got, want := resp.Header.Get("RateLimit"), fmt.Sprintf(`"r0";r=%d;t=`, 2-i); !strings.HasPrefix(got, want) {
				t.Errorf("%s request %d: RateLimit %q, want %s…", user, i+1, got, want)
			}
			if resp.Header.Get("Retry-After") != "" {
				t.Errorf("%s request %d: Retry-After on an admitted request", user, i+1)
			}
		}
		resp, body := get(t, authURL, "Authorization", basic(user))
		if resp == nil {
			t.FailNow()
		}
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("%s request 4: %d %q, want 429", user, resp.StatusCode, body)
		}
		denied++
		checkRejected(t, user+" request 4", resp, `"r0";q=3;w=60`, 60)
	}
	// A wrong password is still 401 (authentication runs first) and is not
	// rate limited as the user.
	if resp, _ := get(t, authURL, "Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(users[0]+":wrong"))); resp == nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("wrong password: %v, want 401", resp)
	}
	// The limit is kept under the user's name, not the shared client IP.
	keys, err := r.Client().Keys(t.Context(), "caddy:rl:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, user := range users {
		if !containsPrefix(keys, "caddy:rl:{"+user+"}:sw:3/") {
			t.Errorf("no Redis key for %s among %v", user, keys)
		}
	}
	if containsPrefix(keys, "caddy:rl:{ip/") {
		t.Errorf("a key fell back to the client IP: %v", keys)
	}

	// Site 2: per header, two rates, in front of redis_lock + reverse_proxy.
	// Each user sends 3 requests at once: the limiter admits 2 (which the
	// lock serialises) and rejects 1 without taking the lock.
	hdrURL := fmt.Sprintf("http://127.0.0.1:%d/work", hdrPort)
	const policy2 = `"r0";q=2;w=60, "r1";q=100;w=3600`
	hdrUsers := []string{"carol-zq7", "dave-zq7", "erin-zq7"}
	type answer struct {
		user string
		resp *http.Response
		body string
		took time.Duration
	}
	answers := make(chan answer, 3*len(hdrUsers))
	var wg sync.WaitGroup
	for _, user := range hdrUsers {
		for i := 0; i < 3; i++ {
			wg.Add(1)
			go func(user string) {
				defer wg.Done()
				t0 := time.Now()
				resp, body := get(t, hdrURL, "X-User-ID", user)
				answers <- answer{user, resp, body, time.Since(t0)}
			}(user)
		}
	}
	wg.Wait()
	close(answers)
	ok, rejected := map[string]int{}, map[string]int{}
	for a := range answers {
		if a.resp == nil {
			t.FailNow()
		}
		if got := a.resp.Header.Get("RateLimit-Policy"); got != policy2 {
			t.Errorf("%s: RateLimit-Policy %q, want %q", a.user, got, policy2)
		}
		switch a.resp.StatusCode {
		case 200:
			ok[a.user]++
			if a.body != "upstream "+a.user {
				t.Errorf("%s: body %q", a.user, a.body)
			}
			if rl := a.resp.Header.Get("RateLimit"); !strings.HasPrefix(rl, `"r0";r=`) {
				t.Errorf("%s: RateLimit %q, want the per-minute rate r0 as the tightest", a.user, rl)
			}
		case http.StatusTooManyRequests:
			rejected[a.user]++
			denied++
			checkRejected(t, a.user+" (concurrent)", a.resp, policy2, 60)
			t.Logf("%s: 429 after %s (the admitted ones hold the lock for 2×60ms)", a.user, a.took)
		default:
			t.Errorf("%s: %d %q, want 200 or 429", a.user, a.resp.StatusCode, a.body)
		}
	}
	mu.Lock()
	for _, user := range hdrUsers {
		if ok[user] != 2 || rejected[user] != 1 {
			t.Errorf("%s: %d admitted and %d rejected, want 2 and 1 (2 per minute, per user)", user, ok[user], rejected[user])
		}
		if maxIn[user] != 1 {
			t.Errorf("%s: %d requests inside the upstream at once, want 1 (the lock serialises)", user, maxIn[user])
		}
		if tk := tokens[user]; len(tk) != 2 {
			t.Errorf("%s: the upstream saw %d requests, want 2 (a rejected request never reaches the lock)", user, len(tk))
		} else if tk[1] <= tk[0] {
			t.Errorf("%s: fencing tokens %v, want increasing", user, tk)
		}
	}
	mu.Unlock()
	// Sequential now: each of them is over its per-minute quota; another
	// user is not.
	for _, user := range hdrUsers {
		resp, _ := get(t, hdrURL, "X-User-ID", user)
		if resp == nil || resp.StatusCode != http.StatusTooManyRequests {
			t.Errorf("%s after its quota: %v, want 429", user, resp)
			continue
		}
		denied++
		checkRejected(t, user+" after its quota", resp, policy2, 60)
	}
	resp, _ := get(t, hdrURL, "X-User-ID", "frank-zq7")
	if resp == nil || resp.StatusCode != 200 {
		t.Errorf("a fresh user: %v, want 200", resp)
	} else if got, want := resp.Header.Get("RateLimit"), `"r0";r=1;t=`; !strings.HasPrefix(got, want) {
		t.Errorf("a fresh user: RateLimit %q, want %s…", got, want)
	}

	// Metrics: denials are counted; no user name is a label or value.
	mresp, err := http.Get(fmt.Sprintf("http://localhost:%d/metrics", admin))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	metrics := string(b)
	for _, result := range []string{"allowed", "denied"} {
		ms := regexp.MustCompile(`(?m)^caddy_redis_ratelimit_requests_total\{handler="[^"]*",result="`+result+`"\} (\d+)`).FindAllStringSubmatch(metrics, -1)
		if ms == nil {
			t.Errorf("metrics lack caddy_redis_ratelimit_requests_total{result=%q}", result)
			continue
		}
		n := 0 // over the handlers
		for _, m := range ms {
			v, _ := strconv.Atoi(m[1])
			n += v
		}
		if result == "denied" && n < denied {
			t.Errorf("caddy_redis_ratelimit_requests_total{result=\"denied\"} = %d, want at least the %d rejections seen", n, denied)
		}
	}
	for _, user := range append(append(append([]string(nil), users...), hdrUsers...), "frank-zq7", "zq7") {
		if strings.Contains(metrics, user) {
			t.Errorf("the user name %q appears in the metrics", user)
		}
	}
}

// checkRejected checks a rejected answer: Retry-After in whole seconds
// (1…maxRetry), the policy, and a RateLimit field with no quota left.
func checkRejected(t *testing.T, what string, resp *http.Response, policy string, maxRetry int) {
	t.Helper()
	ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > maxRetry {
		t.Errorf("%s: Retry-After %q, want whole seconds in 1…%d", what, resp.Header.Get("Retry-After"), maxRetry)
	}
	if got := resp.Header.Get("RateLimit-Policy"); got != policy {
		t.Errorf("%s: RateLimit-Policy %q, want %q", what, got, policy)
	}
	rl := resp.Header.Get("RateLimit")
	m := regexp.MustCompile(`^"r0";r=0;t=(\d+)$`).FindStringSubmatch(rl)
	if m == nil {
		t.Errorf("%s: RateLimit %q, want \"r0\";r=0;t=<seconds>", what, rl)
		return
	}
	if tt, _ := strconv.Atoi(m[1]); tt < 1 || tt > maxRetry {
		t.Errorf("%s: RateLimit t=%d, want 1…%d", what, tt, maxRetry)
	}
}

func containsPrefix(list []string, prefix string) bool {
	for _, s := range list {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}

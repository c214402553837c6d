package redisdlm

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// wholeCaddyMu serialises tests that run the (process-global) Caddy.
var wholeCaddyMu sync.Mutex

// skipWholeCaddyIfShort skips whole-Caddy tests under -short.
func skipWholeCaddyIfShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("whole-Caddy test: skipped under -short")
	}
}

// runCaddy adapts a Caddyfile and runs it as the whole in-process Caddy
// until the test ends.
func runCaddy(t *testing.T, caddyfile string) {
	t.Helper()
	skipWholeCaddyIfShort(t)
	wholeCaddyMu.Lock()
	cfg, warns, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		wholeCaddyMu.Unlock()
		t.Fatalf("adapt: %v", err)
	}
	for _, w := range warns {
		t.Logf("adapt warning: %s", w.Message)
	}
	if err := caddy.Load(cfg, true); err != nil {
		wholeCaddyMu.Unlock()
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		_ = caddy.Stop()
		wholeCaddyMu.Unlock()
	})
}

// TestWholeCaddyReverseProxy runs Caddy with redis_lock in front of
// reverse_proxy to a test upstream: requests for one user are serialised,
// the upstream gets increasing fencing tokens, other users are not held
// up, placeholders reach later handlers, and the metrics show up at the
// admin endpoint.
func TestWholeCaddyReverseProxy(t *testing.T) {
	skipWholeCaddyIfShort(t)
	r := startRedis(t)
	var mu sync.Mutex
	inflight := map[string]int{}
	maxIn := map[string]int{}
	var tokens []int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		user := req.Header.Get("X-User-ID")
		mu.Lock()
		inflight[user]++
		if inflight[user] > maxIn[user] {
			maxIn[user] = inflight[user]
		}
		if user == "alice" {
			tok, _ := strconv.ParseInt(req.Header.Get("Lock-Fencing-Token"), 10, 64)
			tokens = append(tokens, tok)
		}
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		inflight[user]--
		mu.Unlock()
		fmt.Fprintf(w, "token=%s key=%s", req.Header.Get("Lock-Fencing-Token"), req.Header.Get("X-Lock-Key"))
	}))
	defer up.Close()
	port, admin := freePort(t), freePort(t)
	runCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	metrics
	auto_https off
}
:%d {
	redis_lock /profile* {
		key {http.request.header.X-User-ID}
		redis %s
	}
	request_header X-Lock-Key {http.redis_lock.key}
	reverse_proxy %s
}
`, admin, port, r.Addr, strings.TrimPrefix(up.URL, "http://")))

	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	var wg sync.WaitGroup
	for i := 0; i < 30; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			user := "alice"
			if i%3 == 0 {
				user = "bob"
			}
			resp, body := get(t, base+"/profile", "X-User-ID", user)
			if resp == nil || resp.StatusCode != 200 || !strings.Contains(body, "key="+user) {
				t.Errorf("request %d: %v %q", i, resp, body)
			}
		}(i)
	}
	wg.Wait()
	mu.Lock()
	if maxIn["alice"] != 1 || maxIn["bob"] != 1 {
		t.Errorf("max in flight per user %v, want 1 each", maxIn)
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("tokens not increasing: %v", tokens)
			break
		}
	}
	if len(tokens) != 20 {
		t.Errorf("alice served %d times, want 20", len(tokens))
	}
	mu.Unlock()

	// No X-User-ID: the key renders empty, a 400.
	if resp, _ := get(t, base+"/profile"); resp == nil || resp.StatusCode != 400 {
		t.Errorf("no user header: %v, want 400", resp)
	}
	// Outside the matcher: no lock, no token.
	if resp, body := get(t, base+"/other", "X-User-ID", "alice"); resp == nil || resp.StatusCode != 200 || !strings.Contains(body, "token= ") {
		t.Errorf("unmatched path: %v %q, want no token", resp, body)
	}

	resp, err := http.Get(fmt.Sprintf("http://localhost:%d/metrics", admin))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, m := range []string{"caddy_redis_lock_acquire_duration_seconds_count{result=\"acquired\"}", "caddy_redis_lock_held_duration_seconds", "caddy_redis_lock_waiters"} {
		if !strings.Contains(string(b), m) {
			t.Errorf("metrics lack %s", m)
		}
	}
	if strings.Contains(string(b), "alice") {
		t.Error("a key appears in the metrics")
	}
}

// TestWholeCaddyReloadSharesClient: handlers with the same connection
// settings share one client, across a config reload, and a reload leaks no
// client.
func TestWholeCaddyReloadSharesClient(t *testing.T) {
	skipWholeCaddyIfShort(t)
	r := startRedis(t)
	port := freePort(t)
	conf := func(body string) string {
		return fmt.Sprintf(`{
	admin off
	auto_https off
}
:%d {
	redis_lock /a {
		redis %s
	}
	redis_lock /b {
		redis %s
		wait 0
	}
	respond "%s"
}
`, port, r.Addr, r.Addr, body)
	}
	runCaddy(t, conf("one"))
	if n := poolRefs(t, r.Addr); n != 2 {
		t.Errorf("%d handlers hold the pooled client, want 2", n)
	}
	for i := 0; i < 3; i++ {
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(conf(fmt.Sprint("v", i))), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatal(err)
		}
		resp, body := get(t, fmt.Sprintf("http://127.0.0.1:%d/a", port))
		if resp == nil || resp.StatusCode != 200 || body != fmt.Sprint("v", i) {
			t.Fatalf("after reload %d: %v %q", i, resp, body)
		}
	}
	if n := poolRefs(t, r.Addr); n != 2 {
		t.Errorf("after reloads %d references to the pooled client, want 2 (a leak otherwise)", n)
	}
	info, err := r.Client().Info(t.Context(), "clients").Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("redis clients after reloads: %s", strings.TrimSpace(info))
}

// poolRefs counts the references to the pooled client for addr with
// default settings.
func poolRefs(t *testing.T, addr string) int {
	t.Helper()
	s := serverSettings{Mode: "single", Addrs: []string{addr}, Timeout: DefaultTimeout}
	refs, ok := clientPool.References(s.poolKey())
	if !ok {
		return 0
	}
	return refs
}

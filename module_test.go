package redisdlm

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/redis/go-redis/v9"
)

// TestWholeCaddyReverseProxy runs Caddy with redis_lock in front of
// reverse_proxy to a test upstream: requests for one user are serialised,
// the upstream gets increasing fencing tokens, other users are not held
// up, placeholders reach later handlers, and the metrics show up at the
// admin endpoint.
func TestWholeCaddyReverseProxy(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
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
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	metrics
	auto_https off
}
:%d {
	redis_lock /profile* {
		key {http.request.header.X-User-ID}
		redis %s
	}
	reverse_proxy %s {
		header_up X-Lock-Key {http.redis_lock.key}
	}
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
	for _, m := range []string{`caddy_redis_lock_acquire_duration_seconds_count{handler="lock-`, `",result="acquired"}`, "caddy_redis_lock_held_duration_seconds", "caddy_redis_lock_waiters"} {
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
	testkit.SkipWholeCaddyIfShort(t)
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
	testkit.RunCaddy(t, conf("one"))
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
	s := redisconn.Settings{Mode: "single", Addrs: []string{addr}, Timeout: shared.DefaultTimeout}
	refs, ok := shared.ClientPool.References(s.PoolKey())
	if !ok {
		return 0
	}
	return refs
}

// TestClientOptions: every mode gets the plugin's connection settings (no
// resends, one dial per attempt, the pool, the timeout), and a URL's
// address, credentials, database and client name win over the directive's,
// while its other query settings do not replace the plugin's.
func TestClientOptions(t *testing.T) {
	check := redisconn.NewCheck(redisconn.CheckOptions{Logger: func() *slog.Logger { return slog.New(slog.DiscardHandler) }})
	build := func(s redisconn.Settings) redis.UniversalClient {
		t.Helper()
		c, err := s.NewClient(check)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	const timeout = 250 * time.Millisecond
	plugin := func(t *testing.T, what string, pool, maxRetries int, dial, read time.Duration, fifo bool, proto int) {
		t.Helper()
		if pool != redisconn.PoolSize || maxRetries > 0 || dial != timeout || read != timeout || !fifo || proto != 2 {
			t.Errorf("%s: pool %d, retries %d, dial %v, read %v, fifo %v, protocol %d; want the plugin's settings", what, pool, maxRetries, dial, read, fifo, proto)
		}
	}
	simple := func(s redisconn.Settings) *redis.Options { return build(s).(*redis.Client).Options() }

	o := simple(redisconn.Settings{Mode: "single", Addrs: []string{"redis://u:pw@127.0.0.1:6390/3?client_name=x&pool_size=999&dial_timeout=9s&max_retries=7"},
		Username: "dir", Password: "dirpw", DB: 5, Timeout: timeout})
	plugin(t, "URL", o.PoolSize, o.MaxRetries, o.DialTimeout, o.ReadTimeout, o.PoolFIFO, o.Protocol)
	if o.Addr != "127.0.0.1:6390" || o.Username != "u" || o.Password != "pw" || o.DB != 3 || o.ClientName != "x" {
		t.Errorf("URL: addr %q user %q password %q db %d name %q; want the URL's", o.Addr, o.Username, o.Password, o.DB, o.ClientName)
	}
	if o.PoolSize != redisconn.PoolSize || o.DialerRetries != 1 || o.MaxIdleConns != redisconn.PoolSize || o.ConnMaxLifetime != redisconn.ConnMaxLifetime {
		t.Errorf("URL: pool %d, dial retries %d, idle %d, lifetime %v; want %d, 1, %d, %v", o.PoolSize, o.DialerRetries, o.MaxIdleConns, o.ConnMaxLifetime, redisconn.PoolSize, redisconn.PoolSize, redisconn.ConnMaxLifetime)
	}

	o = simple(redisconn.Settings{Mode: "single", Addrs: []string{"redis://127.0.0.1:6390"}, Username: "dir", Password: "dirpw", DB: 5, Timeout: timeout})
	if o.Username != "dir" || o.Password != "dirpw" || o.DB != 5 || o.TLSConfig != nil {
		t.Errorf("URL without credentials: user %q password %q db %d tls %v; want the directive's, no TLS", o.Username, o.Password, o.DB, o.TLSConfig != nil)
	}
	o = simple(redisconn.Settings{Mode: "single", Addrs: []string{"rediss://127.0.0.1:6390"}, Timeout: timeout})
	if o.TLSConfig == nil || o.TLSConfig.ServerName != "127.0.0.1" {
		t.Errorf("rediss:// URL: TLS %+v; want TLS with the URL's server name", o.TLSConfig)
	}
	o = simple(redisconn.Settings{Mode: "single", Addrs: []string{"127.0.0.1:6390"}, Username: "dir", Password: "dirpw", DB: 5, Timeout: timeout})
	plugin(t, "address", o.PoolSize, o.MaxRetries, o.DialTimeout, o.ReadTimeout, o.PoolFIFO, o.Protocol)
	if o.Addr != "127.0.0.1:6390" || o.Username != "dir" || o.Password != "dirpw" || o.DB != 5 {
		t.Errorf("address: %q %q %q %d; want the directive's", o.Addr, o.Username, o.Password, o.DB)
	}

	co := build(redisconn.Settings{Mode: "cluster", Addrs: []string{"127.0.0.1:7001", "127.0.0.1:7002"}, Password: "pw", Timeout: timeout}).(*redis.ClusterClient).Options()
	plugin(t, "cluster", co.PoolSize, co.MaxRetries, co.DialTimeout, co.ReadTimeout, co.PoolFIFO, co.Protocol)
	if len(co.Addrs) != 2 || co.Password != "pw" || co.PoolSize != redisconn.PoolSize || co.DialerRetries != 1 {
		t.Errorf("cluster: addrs %v password %q pool %d dial retries %d", co.Addrs, co.Password, co.PoolSize, co.DialerRetries)
	}

	fo := simple(redisconn.Settings{Mode: "sentinel", Addrs: []string{"127.0.0.1:26390"}, Master: "m", Password: "pw", DB: 2, Timeout: timeout})
	plugin(t, "sentinel", fo.PoolSize, fo.MaxRetries, fo.DialTimeout, fo.ReadTimeout, fo.PoolFIFO, fo.Protocol)
	if fo.Password != "pw" || fo.DB != 2 || fo.PoolSize != redisconn.PoolSize {
		t.Errorf("sentinel: password %q db %d pool %d", fo.Password, fo.DB, fo.PoolSize)
	}
}

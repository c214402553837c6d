package redisdlm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
)

// addressForms are Redis addresses with the reason a rejection must give
// ("" = accepted). secretPW never appears in an error.
const secretPW = "hunter2x"

var addressForms = []struct{ addr, reason string }{
	{"127.0.0.1:6379", ""},
	{"localhost:6379", ""},
	{"redis-1.internal_net:6379", ""},
	{"[::1]:6379", ""},
	{"redis://127.0.0.1:6379", ""},
	{"redis://127.0.0.1", ""},
	{"rediss://user:" + secretPW + "@h:6380/2", ""},
	{"redis://:" + secretPW + "@h", ""},
	{"{env.REDIS_ADDR}", ""},
	{"redis://{env.REDIS_HOST}:6379", ""},
	{"redis//127.0.0.1:6379", "://"},
	{"redis//:" + secretPW + "@127.0.0.1:6379", "://"},
	{"redis:/127.0.0.1:6379", "://"},
	{"127.0.0.1:99999", "port 99999 is out of range 1-65535"},
	{"127.0.0.1:0", "port 0 is out of range"},
	{"127.0.0.1:abc", `port "abc" is not a number`},
	{"127.0.0.1", "missing port"},
	{":6379", "missing host"},
	{"ho!st:6379", "neither an IP address nor a DNS name"},
	{"redis://h:99999", "port 99999 is out of range"},
	{"redis://:" + secretPW + "@h:99999", "port 99999 is out of range"},
	{"redis://:" + secretPW + "@h:1x/", "invalid port"},
	{"redis://h:1/x", "invalid database number"},
	{"http://h:1", "scheme must be redis:// or rediss://"},
	{"redis://h!st:1", "neither an IP address nor a DNS name"},
}

// TestAddressFormsAgree: both handlers accept and reject the same Redis
// address forms, in the Caddyfile and in JSON, and a rejection keeps its
// reason, names directive, subdirective and line (Caddyfile), and never
// shows a password.
func TestAddressFormsAgree(t *testing.T) {
	t.Parallel()
	for _, form := range addressForms {
		for _, sub := range []string{"redis", "cluster"} {
			f := form
			if sub == "cluster" && strings.HasSuffix(f.addr, "/2") {
				f.reason = "supports only database 0" // a Cluster has db 0 only
			}
			var errs []string
			check := func(what string, err error, wantPrefix string) {
				if f.reason == "" {
					if err != nil {
						t.Errorf("%s %s %q: rejected: %v", what, sub, f.addr, err)
					}
					return
				}
				if err == nil {
					t.Errorf("%s %s %q: accepted, want an error saying %q", what, sub, f.addr, f.reason)
					return
				}
				msg := err.Error()
				errs = append(errs, msg)
				if !strings.Contains(msg, f.reason) || !strings.Contains(msg, wantPrefix) {
					t.Errorf("%s %s %q: error %q, want it to start with %q and say %q", what, sub, f.addr, msg, wantPrefix, f.reason)
				}
			}
			for _, dir := range []string{"redis_lock", "redis_ratelimit"} {
				src := fmt.Sprintf("%s {\n\trate 1 1s\n\t%s %s\n}", dir, sub, f.addr)
				if dir == "redis_lock" {
					src = fmt.Sprintf("%s {\n\t%s %s\n}", dir, sub, f.addr)
				}
				var u caddyfile.Unmarshaler = new(RedisLock)
				if dir == "redis_ratelimit" {
					u = new(RedisRateLimit)
				}
				check(dir+" Caddyfile", u.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src)), dir+": "+sub+": ")
				if f.reason != "" && len(errs) > 0 && !strings.Contains(errs[len(errs)-1], "Testfile:3") && !strings.Contains(errs[len(errs)-1], "Testfile:2") {
					t.Errorf("%s %s %q: error %q does not name the Caddyfile line", dir, sub, f.addr, errs[len(errs)-1])
				}
			}
			list, _ := json.Marshal([]string{f.addr})
			lock := new(RedisLock)
			_ = json.Unmarshal([]byte(fmt.Sprintf(`{%q:%s}`, sub, list)), lock)
			check("redis_lock JSON", lock.Validate(), "redis_lock: ")
			rl := new(RedisRateLimit)
			_ = json.Unmarshal([]byte(fmt.Sprintf(`{%q:%s,"rates":[{"requests":1,"window":"1s"}]}`, sub, list)), rl)
			check("redis_ratelimit JSON", rl.Validate(), "redis_ratelimit: ")
			for _, e := range errs {
				if strings.Contains(e, secretPW) {
					t.Errorf("error shows the password: %s", e)
				}
			}
		}
	}
}

// TestPoolKeyFollowsTLSFiles: a client is shared only while the TLS files'
// contents are the same: a reload after a certificate was replaced at the
// same path gets a new client (with the new files), not the old one.
func TestPoolKeyFollowsTLSFiles(t *testing.T) {
	t.Parallel()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, []byte("first"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := shared.RedisConfig{Addresses: []string{"127.0.0.1:6390"}, TLS: true, TLSCAFile: ca}
	key := func() string {
		t.Helper()
		ss, err := cfg.Resolve()
		if err != nil {
			t.Fatal(err)
		}
		return ss[0].PoolKey()
	}
	before := key()
	if key() != before {
		t.Fatal("the same files gave two pool keys")
	}
	if err := os.WriteFile(ca, []byte("rotated"), 0o600); err != nil {
		t.Fatal(err)
	}
	if key() == before {
		t.Fatal("a CA file replaced at the same path kept the old client")
	}
}

// TestTLSClientCertCaddyfile: tls_client_cert sets both files and turns TLS
// on; a wrong argument count is an error with the line; JSON with one file
// of the pair is refused by both handlers.
func TestTLSClientCertCaddyfile(t *testing.T) {
	t.Parallel()
	h := new(RedisLock)
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\ttls_client_cert c.pem c.key\n}")); err != nil {
		t.Fatal(err)
	}
	if h.TLSClientCertFile != "c.pem" || h.TLSClientKeyFile != "c.key" || !h.TLS {
		t.Errorf("parsed %+v", h.RedisConfig)
	}
	b, _ := json.Marshal(h)
	if !strings.Contains(string(b), `"tls_client_cert_file":"c.pem","tls_client_key_file":"c.key"`) {
		t.Errorf("JSON form %s", b)
	}
	for _, body := range []string{"tls_client_cert c.pem", "tls_client_cert", "tls_client_cert a b c"} {
		rl := new(RedisRateLimit)
		err := rl.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_ratelimit {\n\trate 1 1s\n\t" + body + "\n}"))
		if err == nil || !strings.Contains(err.Error(), "redis_ratelimit: tls_client_cert: want <cert_file> <key_file>") || !strings.Contains(err.Error(), "Testfile:3") {
			t.Errorf("%q: %v", body, err)
		}
	}
	lock := new(RedisLock)
	_ = json.Unmarshal([]byte(`{"tls_client_cert_file":"c.pem"}`), lock)
	if err := lock.Validate(); err == nil || !strings.Contains(err.Error(), "redis_lock: tls_client_cert: needs both") {
		t.Errorf("lock with a cert but no key: %v", err)
	}
	rl := new(RedisRateLimit)
	_ = json.Unmarshal([]byte(`{"tls_client_key_file":"c.key","rates":[{"requests":1,"window":"1s"}]}`), rl)
	if err := rl.Validate(); err == nil || !strings.Contains(err.Error(), "redis_ratelimit: tls_client_cert: needs both") {
		t.Errorf("rate limit with a key but no cert: %v", err)
	}
}

// connectedClients reads connected_clients from INFO through c (its own
// connection included).
func connectedClients(t *testing.T, c *redis.Client) int {
	return int(infoInt(t, c, "clients", "connected_clients"))
}

// warmLock is a lock handler (timeout 5s, wait 0) on a Redis of its own,
// served, after one request.
func warmLock(t *testing.T) (*testRedis, *RedisLock, *httptest.Server) {
	t.Helper()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"timeout":"5s","wait":"0s"`))
	s := handlerServer(t, h, okHandler)
	if resp, _ := get(t, s.URL+"/warm"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("warm-up: %v", resp)
	}
	return r, h, s
}

// pausedBurst makes a lock handler's pool grow as a slow Redis does: n
// calls on the handler's shared client meet a paused Redis, each holding a
// connection of its own (the calls that go outside the pipe, redisconn.Pipe:
// extensions, sync_replicas acquires, wait-queue updates), while n locked
// requests wait in the pipe; all succeed once it resumes. It returns the
// handler's server, a client of the test's own and connected_clients
// before and after the burst.
func pausedBurst(t *testing.T, n int) (srv string, rc *redis.Client, base, after int) {
	t.Helper()
	r, h, s := warmLock(t)
	rc = r.Client()
	base = connectedClients(t, rc)
	shared := h.locker.Clients()[0]
	r.Pause()
	var done []<-chan fetchResult
	pings := make(chan error, n)
	for i := 0; i < n; i++ {
		done = append(done, goFetch(context.Background(), fmt.Sprintf("%s/k%d", s.URL, i)))
		go func() { pings <- shared.Ping(context.Background()).Err() }()
	}
	// Every ping waits on a connection of its own: wait until Redis has
	// accepted them all (the kernel completes the handshakes).
	waitFor(3*time.Second, func() bool { return int(shared.PoolStats().TotalConns) >= n })
	r.Resume()
	for i, ch := range done {
		if res := await(t, ch, 20*time.Second, fmt.Sprintf("request %d", i)); res.status != 200 {
			t.Fatalf("request %d: %d %v", i, res.status, res.err)
		}
	}
	for i := 0; i < n; i++ {
		if err := <-pings; err != nil {
			t.Fatalf("ping %d: %v", i, err)
		}
	}
	after = connectedClients(t, rc)
	if after < base+n/2 {
		t.Fatalf("%d connections after %d calls met a paused Redis, %d before: the burst did not grow the pool", after, n, base)
	}
	return s.URL, rc, base, after
}

// TestPausedRedisLeavesLockPoolSmall: locked requests that meet a paused
// Redis wait in the pipe (redisconn.Pipe) instead of each taking a
// connection of its own: the pool grows by at most the pipelines in flight
// and the background release, and every request is served once Redis
// resumes.
func TestPausedRedisLeavesLockPoolSmall(t *testing.T) {
	t.Parallel()
	r, h, s := warmLock(t)
	rc := r.Client()
	base := connectedClients(t, rc)
	r.Pause()
	const n = 48
	var done []<-chan fetchResult
	for i := 0; i < n; i++ {
		done = append(done, goFetch(context.Background(), fmt.Sprintf("%s/p%d", s.URL, i)))
	}
	if !waitFor(5*time.Second, func() bool { return h.locker.QueuedCalls() >= n-redisconn.PipeInFlight }) {
		r.Resume()
		t.Fatalf("%d of %d locked requests queued in the pipe after 5s of a paused Redis, want %d: the test never met its premise", h.locker.QueuedCalls(), n, n-redisconn.PipeInFlight)
	}
	r.Resume()
	for i, ch := range done {
		if res := await(t, ch, 20*time.Second, fmt.Sprintf("request %d", i)); res.status != 200 {
			t.Fatalf("request %d: %d %v", i, res.status, res.err)
		}
	}
	if c := connectedClients(t, rc); c > base+redisconn.PipeInFlight+1 {
		t.Fatalf("%d connections after %d locked requests met a paused Redis, %d before: want at most %d more (the pipelines in flight and the release)",
			c, n, base, redisconn.PipeInFlight+1)
	}
}

// TestPoolShrinksAfterSlowRedis: while Redis is paused, every request holds
// a connection of its own; once those were idle for redisconn.ConnMaxIdle
// (shortened here), they are closed, so the connections come back to about
// what the traffic needs. Not parallel: it shortens redisconn.ConnMaxIdle
// for the clients made meanwhile.
func TestPoolShrinksAfterSlowRedis(t *testing.T) {
	defer func(d time.Duration) { redisconn.ConnMaxIdle = d }(redisconn.ConnMaxIdle)
	redisconn.ConnMaxIdle = 500 * time.Millisecond
	srv, rc, base, after := pausedBurst(t, 48)
	time.Sleep(redisconn.ConnMaxIdle + 200*time.Millisecond)
	for i := 0; i < 30; i++ {
		if resp, _ := get(t, fmt.Sprintf("%s/q%d", srv, i)); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("after the quiet spell: %v", resp)
		}
	}
	// At worst (the reaper not yet done) a call that finds only expired
	// connections closes three and dials one.
	if c := connectedClients(t, rc); c > base+(after-base+2)/3+1 {
		t.Errorf("%d connections after a quiet spell longer than redisconn.ConnMaxIdle (%d before the burst, %d after it); the expired idle ones were not closed", c, base, after)
	}
	t.Logf("connections: %d before, %d after 48 requests met a paused Redis, %d after a quiet spell", base, after, connectedClients(t, rc))
}

// TestPoolClosesIdleWithoutTraffic: after the burst of a paused Redis, no
// call comes at all, and still the idle connections are closed once idle
// for redisconn.ConnMaxIdle (plus the reaper's sweeps). go-redis closes an
// idle connection only when a call takes it, three per call: before the
// reaper, a quiet Caddy kept every connection a burst opened (the soak,
// seed 605460989: a Redlock server at 186 connections after a quiet
// minute and a few probes, 22 before the faults). Not parallel: it
// shortens redisconn.ConnMaxIdle.
func TestPoolClosesIdleWithoutTraffic(t *testing.T) {
	defer func(d time.Duration) { redisconn.ConnMaxIdle = d }(redisconn.ConnMaxIdle)
	redisconn.ConnMaxIdle = 500 * time.Millisecond
	_, rc, base, after := pausedBurst(t, 48)
	// base counts the warm-up's connection, closed too by now.
	if !waitFor(10*time.Second, func() bool { return connectedClients(t, rc) <= base }) {
		t.Fatalf("%d connections 10s after a burst (%d before it, %d after it) with no call since; want them closed after %v idle",
			connectedClients(t, rc), base, after, redisconn.ConnMaxIdle)
	}
}

// TestPoolDialsNothingUnderSteadyLoad: 64 callers lock and release keys
// for a few thousand rounds (more calls in flight than the 16 idle
// connections the pool used to keep): after a warm-up, Redis accepts no new
// connection. Before, every connection handed back beyond 16 idle ones was
// closed and the next call dialled again: about one new connection per
// two locked requests.
func TestPoolDialsNothingUnderSteadyLoad(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"timeout":"5s","wait":"10s"`))
	round := func(from, n int) {
		var wg sync.WaitGroup
		for i := range 64 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := range n {
					ls, err := h.locker.Acquire(t.Context(), []string{shared.StoredKey(h.Prefix, fmt.Sprintf("k%d-%d", i, (from+j)%50))})
					if err != nil {
						t.Error(err)
						return
					}
					ls.Release()
				}
			}()
		}
		wg.Wait()
	}
	rc := r.Client()
	// Warm-up until a whole round opens nothing: the pool grows to what 64
	// callers need (one round is not always enough under CPU load from
	// outside the test; a pool that churns never gets there).
	stable := false
	for w := 0; w < 5 && !stable; w++ {
		before := infoInt(t, rc, "stats", "total_connections_received")
		round(w*20, 20)
		stable = infoInt(t, rc, "stats", "total_connections_received") == before
	}
	if !stable {
		t.Fatal("the pool still opened Redis connections in the fifth warm-up round of 64 callers")
	}
	before := infoInt(t, rc, "stats", "total_connections_received")
	round(20, 60)
	if d := infoInt(t, rc, "stats", "total_connections_received") - before; d != 0 {
		t.Fatalf("%d new Redis connections during 3840 lock-release rounds of 64 callers after a warm-up; want 0", d)
	}
}

// TestRedlockDuplicateServers: a Redlock list that names one server twice
// (which would give it two votes: with the other server down, it alone
// would grant the lock) is refused in JSON, in the Caddyfile with its line,
// and at provision time when a placeholder makes the duplicate; a password
// never shows. Seed lists of a Cluster or a Sentinel may repeat an address.
func TestRedlockDuplicateServers(t *testing.T) {
	a, b := startRedis(t), startRedis(t)
	t.Setenv("REDISDLM_TEST_DUP_ADDR", a.Addr)
	for _, c := range []struct {
		name  string
		addrs []string
		want  string
	}{
		{"same address", []string{a.Addr, a.Addr, b.Addr}, "is listed twice"},
		{"address and URL", []string{a.Addr, "redis://:" + secretPW + "@" + a.Addr + "/0", b.Addr}, "are the same Redis server " + a.Addr},
		{"another db", []string{"redis://" + a.Addr + "/1", b.Addr, "redis://" + a.Addr + "/2"}, "are the same Redis server " + a.Addr},
	} {
		t.Run(c.name, func(t *testing.T) {
			list, _ := json.Marshal(c.addrs)
			h := new(RedisLock)
			if err := json.Unmarshal([]byte(`{"redis":`+string(list)+`}`), h); err != nil {
				t.Fatal(err)
			}
			err := h.Validate()
			if err == nil || !strings.Contains(err.Error(), "redis_lock: redis: ") || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), secretPW) {
				t.Errorf("JSON %s: %v, want an error naming redis_lock: redis: and saying %q, without the password", list, err, c.want)
			}
			src := "redis_lock {\n\tredis " + strings.Join(c.addrs, " ") + "\n}"
			err = new(RedisLock).UnmarshalCaddyfile(caddyfile.NewTestDispenser(src))
			if err == nil || !strings.Contains(err.Error(), "redis_lock: redis: ") || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "Testfile:2") {
				t.Errorf("Caddyfile %q: %v, want an error naming redis_lock: redis:, the line and %q", src, err, c.want)
			}
		})
	}

	// A placeholder is checked once it is replaced, in Provision.
	h := new(RedisLock)
	cfg := fmt.Sprintf(`{"redis":[%q,"{env.REDISDLM_TEST_DUP_ADDR}",%q]}`, a.Addr, b.Addr)
	if err := json.Unmarshal([]byte(cfg), h); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err != nil {
		t.Fatalf("Validate %s: %v, want the placeholder left to Provision", cfg, err)
	}
	if err := new(RedisLock).UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_lock {\n\tredis " + a.Addr + " {env.REDISDLM_TEST_DUP_ADDR} " + b.Addr + "\n}")); err != nil {
		t.Fatalf("Caddyfile with a placeholder address: %v, want it left to Provision", err)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	err := h.Provision(ctx)
	_ = h.Cleanup()
	if err == nil || !strings.Contains(err.Error(), "redis_lock: redis: ") || !strings.Contains(err.Error(), "is listed twice") || !strings.Contains(err.Error(), "placeholders") {
		t.Fatalf("Provision %s: %v, want a duplicate server error", cfg, err)
	}

	// Three distinct servers are a quorum (the third need not run: nothing dials).
	ok := provisionLock(t, fmt.Sprintf(`{"redis":[%q,%q,"127.0.0.1:%d"]}`, a.Addr, "redis://"+b.Addr+"/1", freePort(t)))
	if n := len(ok.locker.Clients()); n != 3 {
		t.Errorf("a quorum of three distinct servers has %d servers", n)
	}

	// redis_ratelimit takes one address: a repeated one is still two.
	rl := new(RedisRateLimit)
	_ = json.Unmarshal([]byte(fmt.Sprintf(`{"redis":[%q,%q],"rates":[{"requests":1,"window":"1s"}]}`, a.Addr, a.Addr)), rl)
	if err := rl.Validate(); err == nil || !strings.Contains(err.Error(), "exactly one logical Redis") {
		t.Errorf("redis_ratelimit with one address twice: %v, want exactly one logical Redis", err)
	}

	// Seeds of a Cluster or a Sentinel group may repeat: a seed only finds the rest.
	for _, cfg := range []string{
		fmt.Sprintf(`{"cluster":[%q,%q]}`, a.Addr, a.Addr),
		fmt.Sprintf(`{"sentinel_master":"m","sentinels":[%q,"redis://%s"]}`, a.Addr, a.Addr),
	} {
		h := new(RedisLock)
		_ = json.Unmarshal([]byte(cfg), h)
		if err := h.Validate(); err != nil {
			t.Errorf("%s: %v, want a repeated seed accepted", cfg, err)
		}
	}
}

// TestSeedURLsResolve: the URLs of a cluster or sentinel list become
// host:port addresses, their user, password, db, client name and scheme
// become the connection's (the directive's user and password apply where
// the URLs carry none), and URLs that disagree, or a cluster URL naming a
// db other than 0, are refused naming the subdirective (and the Caddyfile
// line), without the password.
func TestSeedURLsResolve(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		cfg  shared.RedisConfig
		want redisconn.Settings
	}{
		{"cluster URLs", shared.RedisConfig{Cluster: []string{"rediss://u:" + secretPW + "@h1:7000?client_name=c", "h2:7001", "rediss://u:" + secretPW + "@h3:7002/0?client_name=c"}, Password: "other"},
			redisconn.Settings{Mode: "cluster", Addrs: []string{"h1:7000", "h2:7001", "h3:7002"}, Username: "u", Password: secretPW, TLS: true, ClientName: "c"}},
		{"cluster URLs without credentials", shared.RedisConfig{Cluster: []string{"redis://h1:7000"}, Username: "du", Password: "dp"},
			redisconn.Settings{Mode: "cluster", Addrs: []string{"h1:7000"}, Username: "du", Password: "dp"}},
		{"sentinel URLs", shared.RedisConfig{SentinelMaster: "m", Sentinels: []string{"redis://:" + secretPW + "@s1:26379/3", "redis://:" + secretPW + "@s2:26379/3"}},
			redisconn.Settings{Mode: "sentinel", Master: "m", Addrs: []string{"s1:26379", "s2:26379"}, Password: secretPW, DB: 3}},
	} {
		if err := c.cfg.Validate(true); err != nil {
			t.Errorf("%s: validate: %v", c.name, err)
			continue
		}
		got, err := c.cfg.Resolve()
		if err != nil || len(got) != 1 {
			t.Errorf("%s: resolve: %v, %v", c.name, got, err)
			continue
		}
		c.want.Timeout = shared.DefaultTimeout
		if g, w := fmt.Sprintf("%+v", got[0]), fmt.Sprintf("%+v", c.want); g != w {
			t.Errorf("%s: resolved to\n%s, want\n%s", c.name, g, w)
		}
	}

	for _, c := range []struct {
		sub   string
		addrs []string
		want  string
	}{
		{"cluster", []string{"redis://:" + secretPW + "@h1:1", "redis://:other@h2:1"}, "differ in their password"},
		{"cluster", []string{"redis://h1:1", "rediss://h2:1"}, "differ in their scheme"},
		{"cluster", []string{"redis://a@h1:1", "h2:1", "redis://b@h3:1"}, "differ in their user"},
		{"cluster", []string{"redis://:" + secretPW + "@h1:1/2"}, "supports only database 0"},
		{"sentinel", []string{"redis://s1:1/1", "redis://s2:1/2"}, "differ in their db"},
	} {
		cfg := shared.RedisConfig{Cluster: c.addrs}
		src := "redis_ratelimit {\n\trate 1 1s\n\tcluster " + strings.Join(c.addrs, " ") + "\n}"
		if c.sub == "sentinel" {
			cfg = shared.RedisConfig{SentinelMaster: "m", Sentinels: c.addrs}
			src = "redis_ratelimit {\n\trate 1 1s\n\tsentinel m " + strings.Join(c.addrs, " ") + "\n}"
		}
		errs := []error{cfg.Validate(false)}
		_, err := cfg.Resolve()
		errs = append(errs, err)
		for _, err := range errs {
			if err == nil || !strings.HasPrefix(err.Error(), c.sub+": ") || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), secretPW) {
				t.Errorf("%s %v: %v, want an error naming %s: and saying %q, without the password", c.sub, c.addrs, err, c.sub, c.want)
			}
		}
		err = new(RedisRateLimit).UnmarshalCaddyfile(caddyfile.NewTestDispenser(src))
		if err == nil || !strings.Contains(err.Error(), "redis_ratelimit: "+c.sub+": ") || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "Testfile:3") || strings.Contains(err.Error(), secretPW) {
			t.Errorf("Caddyfile %q: %v, want an error naming redis_ratelimit: %s:, the line and %q", src, err, c.sub, c.want)
		}
	}
}

// TestClusterURLSeeds: a Cluster whose nodes need a password works with
// redis:// seeds that carry it: the rate limiter counts exactly and a lock
// is taken (go-redis was once handed the URLs as addresses and never
// connected).
func TestClusterURLSeeds(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	ctx := context.Background()
	for _, r := range rs {
		if err := r.Client().ConfigSet(ctx, "requirepass", secretPW).Err(); err != nil {
			t.Fatal(err)
		}
	}
	seeds := []string{"redis://:" + secretPW + "@" + rs[0].Addr, "redis://:" + secretPW + "@" + rs[1].Addr + "/0"}
	rl := newRateLimit(t, rs[0], func(h *RedisRateLimit) {
		h.Addresses, h.Cluster = nil, seeds
		h.FailClosed = true
		h.Rates = []Rate{{Requests: 3, Window: caddy.Duration(time.Minute)}}
	})
	rls := handlerServer(t, rl, okHandler)
	ok := 0
	for i := 0; i < 5; i++ {
		resp, body := get(t, rls.URL+"/")
		if resp != nil && resp.StatusCode == 200 {
			ok++
		} else if resp == nil || resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("rate limit on a cluster with URL seeds: %v %s", resp, body)
		}
	}
	if ok != 3 {
		t.Errorf("admitted %d of 5 with a limit of 3", ok)
	}

	list, _ := json.Marshal(seeds)
	lock := provisionLock(t, fmt.Sprintf(`{"cluster":%s,"timeout":"3s"}`, list))
	ls := handlerServer(t, lock, okHandler)
	for i := 0; i < 3; i++ {
		if resp, body := get(t, ls.URL+"/k"); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("lock on a cluster with URL seeds: %v %s", resp, body)
		}
	}
	// The keys are in the cluster, behind its password.
	keys := 0
	for _, r := range rs {
		c := redis.NewClient(&redis.Options{Addr: r.Addr, Password: secretPW})
		n, err := c.DBSize(ctx).Result()
		c.Close()
		if err != nil {
			t.Fatalf("DBSIZE on %s: %v", r.Addr, err)
		}
		keys += int(n)
	}
	if keys == 0 {
		t.Error("no key in the cluster")
	}
}

// TestSentinelURL: a sentinel given as a URL that carries the master's
// password and db leads to the master, with that password and db.
func TestSentinelURL(t *testing.T) {
	t.Parallel()
	master := startRedis(t)
	sentinel := startSentinel(t, master)
	ctx := context.Background()
	sc := redis.NewSentinelClient(&redis.Options{Addr: sentinel})
	defer sc.Close()
	if err := sc.Set(ctx, "mymaster", "auth-pass", secretPW).Err(); err != nil {
		t.Fatal(err)
	}
	if err := master.Client().ConfigSet(ctx, "requirepass", secretPW).Err(); err != nil {
		t.Fatal(err)
	}
	h := provisionLock(t, fmt.Sprintf(`{"sentinel_master":"mymaster","sentinels":["redis://:%s@%s/2"],"timeout":"3s"}`, secretPW, sentinel))
	srv := handlerServer(t, h, okHandler)
	for i := 0; i < 3; i++ {
		if resp, body := get(t, srv.URL+"/s"); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("lock through a sentinel URL: %v %s", resp, body)
		}
	}
	c := redis.NewClient(&redis.Options{Addr: master.Addr, Password: secretPW, DB: 2})
	defer c.Close()
	if v, _ := c.Get(ctx, lock.FenceKey(shared.StoredKey(h.Prefix, "/s"))).Int(); v < 1 {
		t.Errorf("fencing counter in db 2 of the master is %d; the lock did not go there", v)
	}
}

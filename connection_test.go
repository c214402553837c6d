package redisdlm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
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
				var u caddyfile.Unmarshaler = new(redislock.RedisLock)
				if dir == "redis_ratelimit" {
					u = new(redisratelimit.RedisRateLimit)
				}
				check(dir+" Caddyfile", u.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src)), dir+": "+sub+": ")
				if f.reason != "" && len(errs) > 0 && !strings.Contains(errs[len(errs)-1], "Testfile:3") && !strings.Contains(errs[len(errs)-1], "Testfile:2") {
					t.Errorf("%s %s %q: error %q does not name the Caddyfile line", dir, sub, f.addr, errs[len(errs)-1])
				}
			}
			list, _ := json.Marshal([]string{f.addr})
			lock := new(redislock.RedisLock)
			_ = json.Unmarshal([]byte(fmt.Sprintf(`{%q:%s}`, sub, list)), lock)
			check("redis_lock JSON", lock.Validate(), "redis_lock: ")
			rl := new(redisratelimit.RedisRateLimit)
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
	h := new(redislock.RedisLock)
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
		rl := new(redisratelimit.RedisRateLimit)
		err := rl.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_ratelimit {\n\trate 1 1s\n\t" + body + "\n}"))
		if err == nil || !strings.Contains(err.Error(), "redis_ratelimit: tls_client_cert: want <cert_file> <key_file>") || !strings.Contains(err.Error(), "Testfile:3") {
			t.Errorf("%q: %v", body, err)
		}
	}
	lock := new(redislock.RedisLock)
	_ = json.Unmarshal([]byte(`{"tls_client_cert_file":"c.pem"}`), lock)
	if err := lock.Validate(); err == nil || !strings.Contains(err.Error(), "redis_lock: tls_client_cert: needs both") {
		t.Errorf("lock with a cert but no key: %v", err)
	}
	rl := new(redisratelimit.RedisRateLimit)
	_ = json.Unmarshal([]byte(`{"tls_client_key_file":"c.key","rates":[{"requests":1,"window":"1s"}]}`), rl)
	if err := rl.Validate(); err == nil || !strings.Contains(err.Error(), "redis_ratelimit: tls_client_cert: needs both") {
		t.Errorf("rate limit with a key but no cert: %v", err)
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
		err = new(redisratelimit.RedisRateLimit).UnmarshalCaddyfile(caddyfile.NewTestDispenser(src))
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
	list, _ := json.Marshal(seeds)
	rl := provisionRateLimitJSON(t, fmt.Sprintf(`{"cluster":%s,"timeout":"5s","fail_closed":true,"rates":[{"requests":3,"window":"1m"}]}`, list))
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

// TestRateLimitRepeatedAddress: redis_ratelimit takes one address, and a
// repeated one is still two (redislock's TestRedlockDuplicateServers has
// the lock's rule).
func TestRateLimitRepeatedAddress(t *testing.T) {
	t.Parallel()
	a := startRedis(t)
	// redis_ratelimit takes one address: a repeated one is still two.
	rl := new(redisratelimit.RedisRateLimit)
	_ = json.Unmarshal([]byte(fmt.Sprintf(`{"redis":[%q,%q],"rates":[{"requests":1,"window":"1s"}]}`, a.Addr, a.Addr)), rl)
	if err := rl.Validate(); err == nil || !strings.Contains(err.Error(), "exactly one logical Redis") {
		t.Errorf("redis_ratelimit with one address twice: %v, want exactly one logical Redis", err)
	}
}

package redislock

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
)

// TestRedlockDuplicateServers: a Redlock list that names one server twice
// (which would give it two votes: with the other server down, it alone
// would grant the lock) is refused in JSON, in the Caddyfile with its line,
// and at provision time when a placeholder makes the duplicate; a password
// never shows. Seed lists of a Cluster or a Sentinel may repeat an address.
// (redis_ratelimit, which takes one address: the root's
// TestRateLimitRepeatedAddress.)
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

// TestSentinelLock: redis_lock through a Sentinel-managed Redis (the client
// asks the sentinel for the master) is exclusive, and the lock lives on the
// master.
func TestSentinelLock(t *testing.T) {
	t.Parallel()
	master := startRedis(t)
	sentinel := startSentinel(t, master)
	up := testkit.NewExclusivityUpstream(time.Millisecond)
	h := provisionLock(t, fmt.Sprintf(`{"sentinel_master":"mymaster","sentinels":["%s"],"wait":"30s","timeout":"3s"}`, sentinel))
	srv := handlerServer(t, h, up.ServeHTTP)
	hammerLock(t, 40, 40, srv.URL+"/s")
	up.Check(t)
	if v, _ := master.Client().Get(context.Background(), lock.FenceKey(shared.StoredKey(h.Prefix, "/s"))).Int(); v < 1 {
		t.Errorf("fencing counter on the master is %d; the lock did not go through the sentinel's master", v)
	}
}

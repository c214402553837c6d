package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redisfence"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// provisionFence builds a redis_fence handler from its JSON form.
func provisionFence(t *testing.T, cfg string) *redisfence.RedisFence {
	t.Helper()
	h := new(redisfence.RedisFence)
	testkit.Provision(t, cfg, h)
	return h
}

// TestFenceRefusesAStaleHolder: two tiers —
// redis_lock in front of an app, redis_fence in front of the storage. The
// first holder stalls past its ttl (no extension: a pause), a rival takes
// the lock and writes; when the stalled holder's write arrives the fence
// answers 409 and the storage never sees it. The lock uses on_lost
// continue, so the stale holder really sends its write: fencing protects
// the data, not just the order of the tokens.
func TestFenceRefusesAStaleHolder(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	r.AwaitUptime(3 * time.Second) // the lock's tokens are newer than the fence's Redis
	store := new(testkit.FenceStorage)
	fence := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"key":"{http.request.uri.path}","name":"stale-fence"}`, r.Addr))
	fenceSrv := handlerServer(t, fence, store.ServeHTTP)

	lock := provisionLock(t, testkit.LockConfig(r.Addr, `"ttl":"1s","auto_extend":false,"on_lost":"continue","wait":"10s","timeout":"5s"`))
	stall := make(chan struct{})
	var unstall sync.Once
	release := func() { unstall.Do(func() { close(stall) }) }
	defer release() // before the servers' cleanup, which waits for the stalled handler
	first := true
	var mu sync.Mutex
	app := func(w http.ResponseWriter, req *http.Request) error {
		mu.Lock()
		stale := first
		first = false
		mu.Unlock()
		if stale {
			<-stall // paused past its lease
		}
		out, _ := http.NewRequest("PUT", fenceSrv.URL+req.URL.Path, nil)
		out.Header.Set(redislock.DefaultFencingHeader, req.Header.Get(redislock.DefaultFencingHeader))
		resp, err := http.DefaultClient.Do(out)
		if err != nil {
			return err
		}
		resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		return nil
	}
	lockSrv := handlerServer(t, lock, app)

	staleAnswer := testkit.GoFetch(context.Background(), lockSrv.URL+"/accounts/7")
	if !waitFor(10*time.Second, func() bool { return heldBy(r, shared.StoredKey(lock.Prefix, "/accounts/7")) == 1 }) {
		t.Fatal("the first holder never held the lock")
	}
	before := fenceCount("stale-fence", shared.FenceStale)
	// The rival waits for the lease to run out (1 s), takes the lock, writes.
	if resp, _ := get(t, lockSrv.URL+"/accounts/7"); resp == nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("the rival's write: %v, want 204 from the storage", resp)
	}
	release()
	res := testkit.Await(t, staleAnswer, 20*time.Second, "the stale holder")
	if res.Status != http.StatusConflict {
		t.Fatalf("the stale holder's write: %d, want 409 from the fence", res.Status)
	}
	writes := store.Seen()
	if len(writes) != 1 {
		t.Fatalf("the storage saw %d writes (%v), want only the rival's", len(writes), writes)
	}
	if got := fenceCount("stale-fence", shared.FenceStale) - before; got < 1 {
		t.Errorf("caddy_redis_fence_writes_total{result=stale} rose by %v, want at least 1", got)
	}
}

// fenceCount reads caddy_redis_fence_writes_total of one handler for one result.
func fenceCount(handler string, result int) float64 {
	shared.InitMetrics()
	return testkit.Count(shared.FenceWritesVec.WithLabelValues(handler, shared.FenceResults[result]))
}

// TestFenceCaddyfile: the syntax, its errors with the line, and the
// directive order (redis_fence runs after redis_lock on one route).
func TestFenceCaddyfile(t *testing.T) {
	t.Parallel()
	h := new(redisfence.RedisFence)
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_fence {\n\tkey {http.request.header.X-Account}\n\ttoken {http.request.header.X-Token}\n\tstatus 412\n\tretain 1h\n\tprefix f:\n\tredis 127.0.0.1:6379\n}"))
	if err != nil || h.Key != "{http.request.header.X-Account}" || h.Status != 412 || time.Duration(h.Retain) != time.Hour || h.Prefix != "f:" {
		t.Fatalf("parse: %v %+v", err, h)
	}
	for _, tc := range []struct{ block, want string }{
		{"retain 10ms", "retain: want at least 1s"},
		{"status 200", "status"},
		{"token {http.request.heder.X}", "does not exist"},
		{"redis 127.0.0.1:1 127.0.0.1:2", "exactly one"},
		{"jitter 0.1", "unknown subdirective"},
		{"retain 1h\n\tretain 2h", "given twice"},
		{`token ""`, "token: must not be empty"},
		{`key ""`, "key: "},
	} {
		err := new(redisfence.RedisFence).UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_fence {\n\t" + tc.block + "\n}"))
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "redis_fence") {
			t.Errorf("%q: %v, want an error with %q", tc.block, err, tc.want)
		}
	}
	raw, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":8080 {\n\tredis_fence\n\tredis_lock\n\treverse_proxy 127.0.0.1:1\n}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := string(raw)
	if l, f := strings.Index(cfg, `"redis_lock"`), strings.Index(cfg, `"redis_fence"`); l < 0 || f < 0 || f < l {
		t.Fatalf("adapted order: redis_lock at %d, redis_fence at %d; want the lock first", l, f)
	}
}

// TestFenceUnderMinimalACL: redis_fence works as the README's minimal ACL
// user: it admits a current token and refuses an older one.
func TestFenceUnderMinimalACL(t *testing.T) {
	t.Parallel()
	r := startACLRedis(t)
	admin := aclAdmin(t, r)
	// The fence refuses tokens of its Redis process's first seconds.
	if !waitFor(20*time.Second, func() bool {
		info, _ := admin.Info(t.Context(), "server").Result()
		return strings.Contains(info, "uptime_in_seconds:") && !strings.Contains(info, "uptime_in_seconds:0\r") &&
			!strings.Contains(info, "uptime_in_seconds:1\r") && !strings.Contains(info, "uptime_in_seconds:2\r")
	}) {
		t.Fatal("the ACL Redis never reported an uptime of 3 s")
	}
	store := new(testkit.FenceStorage)
	fence := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"username":%q,"password":%q,"timeout":"2s"}`, r.Addr, aclUser, aclPassword))
	srv := handlerServer(t, fence, store.ServeHTTP)
	now, err := admin.Time(t.Context()).Result()
	if err != nil {
		t.Fatal(err)
	}
	tok := now.UnixMicro()
	for _, c := range []struct {
		token int64
		want  int
	}{{tok, http.StatusNoContent}, {tok - 1000, http.StatusConflict}} {
		if resp, body := get(t, srv.URL+"/acct", redislock.DefaultFencingHeader, strconv.FormatInt(c.token, 10)); resp == nil || resp.StatusCode != c.want {
			t.Fatalf("token %d as the minimal ACL user: %v %s, want %d", c.token, resp, body, c.want)
		}
	}
}

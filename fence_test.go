package redisdlm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// storage records the fencing token of every write that reaches it.
type storage struct {
	mu     sync.Mutex
	writes []int64
}

func (s *storage) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	tok, _ := strconv.ParseInt(r.Header.Get(DefaultFencingHeader), 10, 64)
	s.mu.Lock()
	s.writes = append(s.writes, tok)
	s.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *storage) seen() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int64(nil), s.writes...)
}

// TestFenceRefusesAStaleHolder (issue 23 item 3, SPEC §3b): two tiers —
// redis_lock in front of an app, redis_fence in front of the storage. The
// first holder stalls past its ttl (no extension: a pause), a rival takes
// the lock and writes; when the stalled holder's write arrives the fence
// answers 409 and the storage never sees it. The lock uses on_lost
// continue, so the stale holder really sends its write: fencing protects
// the data, not just the order of the tokens.
func TestFenceRefusesAStaleHolder(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	awaitRedisAge(t, r) // the lock's tokens are newer than the fence's Redis
	store := new(storage)
	fence := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"key":"{http.request.uri.path}"}`, r.Addr))
	fenceSrv := handlerServer(t, fence, store.ServeHTTP)

	lock := provisionLock(t, lockCfg(r.Addr, `"ttl":"1s","auto_extend":false,"on_lost":"continue","wait":"10s","timeout":"5s"`))
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
		out.Header.Set(DefaultFencingHeader, req.Header.Get(DefaultFencingHeader))
		resp, err := http.DefaultClient.Do(out)
		if err != nil {
			return err
		}
		resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		return nil
	}
	lockSrv := handlerServer(t, lock, app)

	staleAnswer := goFetch(context.Background(), lockSrv.URL+"/accounts/7")
	if !waitFor(10*time.Second, func() bool { return heldBy(r, shared.StoredKey(lock.Prefix, "/accounts/7")) == 1 }) {
		t.Fatal("the first holder never held the lock")
	}
	before := fenceCount(fence.label, shared.FenceStale)
	// The rival waits for the lease to run out (1 s), takes the lock, writes.
	if resp, _ := get(t, lockSrv.URL+"/accounts/7"); resp == nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("the rival's write: %v, want 204 from the storage", resp)
	}
	release()
	res := await(t, staleAnswer, 20*time.Second, "the stale holder")
	if res.status != http.StatusConflict {
		t.Fatalf("the stale holder's write: %d, want 409 from the fence", res.status)
	}
	writes := store.seen()
	if len(writes) != 1 {
		t.Fatalf("the storage saw %d writes (%v), want only the rival's", len(writes), writes)
	}
	if got := fenceCount(fence.label, shared.FenceStale) - before; got < 1 {
		t.Errorf("caddy_redis_fence_writes_total{result=stale} rose by %v, want at least 1", got)
	}
}

// TestFenceAcrossRedisRestart (issue 47 row 8, SPEC §3b): T2 is written
// and T1 < T2 refused; the fence's Redis is killed (SIGKILL) and restarted
// empty on its port, so the record that refused T1 is gone. The fence
// still refuses every token older than the new process: T1 twice (the
// first call after the restart goes on a new connection with the old
// start, and its verdict must not count; the second knows the new start)
// and T2 as well, whose hold would span the restart. The storage sees
// neither; a token issued after the restart is admitted.
func TestFenceAcrossRedisRestart(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	store := new(storage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"timeout":"2s"}`, r.Addr))
	srv := handlerServer(t, h, store.ServeHTTP)
	put := func(token int64) int {
		t.Helper()
		resp, _ := get(t, srv.URL+"/accounts/7", DefaultFencingHeader, strconv.FormatInt(token, 10))
		if resp == nil {
			t.Fatalf("token %d: no answer", token)
		}
		return resp.StatusCode
	}
	awaitRedisAge(t, r)
	t1 := redisMicros(t, r)
	t2 := t1 + 1000
	if got := put(t2); got != http.StatusNoContent {
		t.Fatalf("T2 before the restart: %d, want 204", got)
	}
	if got := put(t1); got != http.StatusConflict {
		t.Fatalf("T1 < T2 before the restart: %d, want 409", got)
	}
	before := fenceCount(h.label, shared.FenceStale)
	r.Restart()
	for _, tc := range []struct {
		name  string
		token int64
	}{{"T1, first call after the restart", t1}, {"T1 again", t1}, {"T2, a hold across the restart", t2}} {
		if got := put(tc.token); got != http.StatusConflict {
			t.Errorf("%s: %d, want 409 (the token is older than the fence's Redis process)", tc.name, got)
		}
	}
	if got := fenceCount(h.label, shared.FenceStale) - before; got != 3 {
		t.Errorf("caddy_redis_fence_writes_total{result=stale} rose by %v after the restart, want 3", got)
	}
	awaitRedisAge(t, r)
	t3 := redisMicros(t, r)
	if got := put(t3); got != http.StatusNoContent {
		t.Errorf("a token issued after the restart: %d, want 204", got)
	}
	if got, want := store.seen(), []int64{t2, t3}; !slices.Equal(got, want) {
		t.Errorf("the storage saw %v, want T2 before the restart and the new token after it, %v", got, want)
	}
}

// TestFenceWarnsWithoutRedisStart: under an ACL that refuses INFO the
// fence cannot know when its Redis started. It keeps fencing by the
// records, and says once, naming the server, that restart protection is
// off.
func TestFenceWarnsWithoutRedisStart(t *testing.T) {
	t.Parallel()
	r := startRedis(t, "--user", "default", "off", "--user", "fence", "on", ">fence-pw",
		"~caddy:fence:*", "-@all", "+evalsha", "+eval", "+time", "+get", "+set", "+pexpire", "+ping")
	store := new(storage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"username":"fence","password":"fence-pw"}`, r.Addr))
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	srv := handlerServer(t, h, store.ServeHTTP)
	tok := time.Now().UnixMicro()
	for i, tc := range []struct {
		token int64
		want  int
	}{{tok, http.StatusNoContent}, {tok + 1, http.StatusNoContent}, {tok, http.StatusConflict}} {
		resp, _ := get(t, srv.URL+"/k", DefaultFencingHeader, strconv.FormatInt(tc.token, 10))
		if resp == nil || resp.StatusCode != tc.want {
			t.Fatalf("write %d: %v, want %d", i+1, resp, tc.want)
		}
	}
	warned := logs.FilterMessageSnippet("restart protection off").All()
	if len(warned) != 1 {
		t.Fatalf("%d warnings that restart protection is off, want 1 (logs: %v)", len(warned), logs.All())
	}
	if got := warned[0].ContextMap()["server"]; got != r.Addr {
		t.Errorf("the warning names the server %v, want %s", got, r.Addr)
	}
}

// awaitRedisAge waits until r's process is 3 s old (INFO's uptime). The
// fence knows when a Redis process started only to the second, and errs
// late (up to 2 s after the real start): it refuses tokens issued in the
// process's first seconds, as older than the process.
func awaitRedisAge(t testing.TB, r *testRedis) {
	t.Helper()
	c := r.Client()
	if !waitFor(20*time.Second, func() bool {
		info, err := c.Info(context.Background(), "server").Result()
		if err != nil {
			return false
		}
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "uptime_in_seconds:"); ok {
				up, _ := strconv.Atoi(v)
				return up >= 3
			}
		}
		return false
	}) {
		t.Fatalf("%s never reported an uptime of 3 s", r)
	}
}

// redisMicros is r's TIME in µs: a fencing token as a lock on r would
// issue it now.
func redisMicros(t testing.TB, r *testRedis) int64 {
	t.Helper()
	now, err := r.Client().Time(context.Background()).Result()
	if err != nil {
		t.Fatalf("%s: TIME: %v", r, err)
	}
	return now.UnixMicro()
}

// fenceCount reads caddy_redis_fence_writes_total of one handler for one result.
func fenceCount(handler string, result int) float64 {
	shared.InitMetrics()
	var m dto.Metric
	_ = shared.FenceWritesVec.WithLabelValues(handler, shared.FenceResults[result]).Write(&m)
	return m.GetCounter().GetValue()
}

func provisionFence(t *testing.T, cfg string) *RedisFence {
	t.Helper()
	h := new(RedisFence)
	provisionJSON(t, cfg, h)
	h.logger = quietLogger()
	return h
}

// TestFenceAnswers: the fence's answers one by one. The same token again is
// admitted (one holder writing twice), a lower one is 409; a missing or
// malformed token is 409 and reaches nothing; a token older than
// TIME − retain is stale without a record, one from the future is refused
// (it would fence every real holder out); Redis unreachable is 503.
func TestFenceAnswers(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	store := new(storage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"retain":"10s","timeout":"1s"}`, r.Addr))
	srv := handlerServer(t, h, store.ServeHTTP)
	awaitRedisAge(t, r)
	now := time.Now().UnixMicro()
	put := func(path, token string) int {
		t.Helper()
		req, _ := http.NewRequest("PUT", srv.URL+path, nil)
		if token != "" {
			req.Header.Set(DefaultFencingHeader, token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	tok := func(d time.Duration) string { return strconv.FormatInt(now+d.Microseconds(), 10) }
	for _, tc := range []struct {
		name, path, token string
		want              int
	}{
		{"first token", "/x", tok(0), 204},
		{"same token again", "/x", tok(0), 204},
		{"higher token", "/x", tok(time.Millisecond), 204},
		{"lower token", "/x", tok(0), 409},
		{"another key", "/y", tok(0), 204},
		{"missing token", "/x", "", 409},
		{"malformed token", "/x", "12a", 409},
		{"signed token", "/x", "+" + tok(2*time.Millisecond), 409},
		{"negative token", "/x", "-5", 409},
		{"older than retain, no record", "/z", tok(-time.Minute), 409},
		{"from the future", "/w", tok(2 * time.Hour), 409},
	} {
		if got := put(tc.path, tc.token); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
	if n := len(store.seen()); n != 4 {
		t.Errorf("the storage saw %d writes, want the 4 admitted", n)
	}
	if ttl := r.Client().PTTL(context.Background(), shared.StoredKey(DefaultFencePrefix, "/x")).Val(); ttl <= 0 || ttl > 10*time.Second {
		t.Errorf("the record of /x expires in %v, want within retain (10s)", ttl)
	}
	r.Kill()
	if got := put("/x", tok(time.Second)); got != http.StatusServiceUnavailable {
		t.Errorf("Redis down: %d, want 503", got)
	}
	if n := len(store.seen()); n != 4 {
		t.Errorf("with Redis down the storage saw a write")
	}
}

// TestFenceCaddyfile: the syntax, its errors with the line, and the
// directive order (redis_fence runs after redis_lock on one route).
func TestFenceCaddyfile(t *testing.T) {
	t.Parallel()
	h := new(RedisFence)
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
		err := new(RedisFence).UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis_fence {\n\t" + tc.block + "\n}"))
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

// TestFenceJSONShorthandToken: a token template in JSON with a Caddyfile
// shorthand renders as Validate checked it (SPEC §6: the same placeholder
// forms in the Caddyfile and in JSON alike).
func TestFenceJSONShorthandToken(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	store := new(storage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"token":"{header.X-Tok}"}`, r.Addr))
	srv := handlerServer(t, h, store.ServeHTTP)
	awaitRedisAge(t, r)
	req, _ := http.NewRequest("PUT", srv.URL+"/s", nil)
	req.Header.Set("X-Tok", strconv.FormatInt(time.Now().UnixMicro(), 10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 || len(store.seen()) != 1 {
		t.Fatalf("a fresh token in X-Tok: %d, storage saw %d writes; want 204 and 1", resp.StatusCode, len(store.seen()))
	}
}

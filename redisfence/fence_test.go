package redisfence

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestFenceAcrossRedisRestart: T2 is written
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
	store := new(testkit.FenceStorage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"timeout":"2s"}`, r.Addr))
	srv := handlerServer(t, h, store.ServeHTTP)
	put := func(token int64) int {
		t.Helper()
		resp, _ := get(t, srv.URL+"/accounts/7", shared.DefaultFencingHeader, strconv.FormatInt(token, 10))
		if resp == nil {
			t.Fatalf("token %d: no answer", token)
		}
		return resp.StatusCode
	}
	r.AwaitUptime(3 * time.Second)
	t1 := r.Micros()
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
	r.AwaitUptime(3 * time.Second)
	t3 := r.Micros()
	if got := put(t3); got != http.StatusNoContent {
		t.Errorf("a token issued after the restart: %d, want 204", got)
	}
	if got, want := store.Seen(), []int64{t2, t3}; !slices.Equal(got, want) {
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
	store := new(testkit.FenceStorage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"username":"fence","password":"fence-pw"}`, r.Addr))
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	srv := handlerServer(t, h, store.ServeHTTP)
	tok := time.Now().UnixMicro()
	for i, tc := range []struct {
		token int64
		want  int
	}{{tok, http.StatusNoContent}, {tok + 1, http.StatusNoContent}, {tok, http.StatusConflict}} {
		resp, _ := get(t, srv.URL+"/k", shared.DefaultFencingHeader, strconv.FormatInt(tc.token, 10))
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

// fenceCount reads caddy_redis_fence_writes_total of one handler for one result.
func fenceCount(handler string, result int) float64 {
	shared.InitMetrics()
	return testkit.Count(shared.FenceWritesVec.WithLabelValues(handler, shared.FenceResults[result]))
}

func provisionFence(t *testing.T, cfg string) *RedisFence {
	t.Helper()
	h := new(RedisFence)
	testkit.Provision(t, cfg, h)
	h.logger = testkit.QuietLogger()
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
	store := new(testkit.FenceStorage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"retain":"10s","timeout":"1s"}`, r.Addr))
	srv := handlerServer(t, h, store.ServeHTTP)
	r.AwaitUptime(3 * time.Second)
	now := time.Now().UnixMicro()
	put := func(path, token string) int {
		t.Helper()
		req, _ := http.NewRequest("PUT", srv.URL+path, nil)
		if token != "" {
			req.Header.Set(shared.DefaultFencingHeader, token)
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
	if n := len(store.Seen()); n != 4 {
		t.Errorf("the storage saw %d writes, want the 4 admitted", n)
	}
	if ttl := r.Client().PTTL(context.Background(), shared.StoredKey(DefaultFencePrefix, "/x")).Val(); ttl <= 0 || ttl > 10*time.Second {
		t.Errorf("the record of /x expires in %v, want within retain (10s)", ttl)
	}
	r.Kill()
	if got := put("/x", tok(time.Second)); got != http.StatusServiceUnavailable {
		t.Errorf("Redis down: %d, want 503", got)
	}
	if n := len(store.Seen()); n != 4 {
		t.Errorf("with Redis down the storage saw a write")
	}
}

// TestFenceJSONShorthandToken: a token template in JSON with a Caddyfile
// shorthand renders as Validate checked it (the same placeholder
// forms in the Caddyfile and in JSON alike).
func TestFenceJSONShorthandToken(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	store := new(testkit.FenceStorage)
	h := provisionFence(t, fmt.Sprintf(`{"redis":["%s"],"token":"{header.X-Tok}"}`, r.Addr))
	srv := handlerServer(t, h, store.ServeHTTP)
	r.AwaitUptime(3 * time.Second)
	req, _ := http.NewRequest("PUT", srv.URL+"/s", nil)
	req.Header.Set("X-Tok", strconv.FormatInt(time.Now().UnixMicro(), 10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 || len(store.Seen()) != 1 {
		t.Fatalf("a fresh token in X-Tok: %d, storage saw %d writes; want 204 and 1", resp.StatusCode, len(store.Seen()))
	}
}

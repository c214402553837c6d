package redislock

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// TestAdminOnCluster: the admin API's lock calls work on a Redis Cluster
// (every script's keys share one hash slot), and a force-released lease
// cannot be extended. (The quota calls: the root's TestAdminQuotaOnCluster.)
func TestAdminOnCluster(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	seeds := fmt.Sprintf(`["%s","%s"]`, rs[0].Addr, rs[1].Addr)
	h := provisionLock(t, fmt.Sprintf(`{"cluster":%s,"timeout":"2s","name":"c"}`, seeds))
	call := func(method, key string, f func(w http.ResponseWriter, r *http.Request) error) (int, string) {
		return testkit.AdminCall(t, method, key, f)
	}
	ctx := t.Context()
	for _, key := range []string{"alpha", "beta/1", "gamma"} {
		rk := shared.StoredKey(h.Prefix, key)
		ls, err := h.locker.Acquire(ctx, []string{rk})
		if err != nil {
			t.Fatal(err)
		}
		status, body := call("GET", key, func(w http.ResponseWriter, r *http.Request) error {
			return h.inspectLock(w, r, &shared.AdminEntry{Handler: h}, key)
		})
		if status != 200 || !strings.Contains(body, `"holder_count": 1`) || !strings.Contains(body, `"held": true`) {
			t.Errorf("inspect %s on a cluster: %d %s", key, status, body)
		}
		status, body = call("POST", key, func(w http.ResponseWriter, r *http.Request) error {
			return h.releaseLock(w, r, &shared.AdminEntry{Handler: h}, key)
		})
		if status != 200 || !strings.Contains(body, `"holders_removed": 1`) {
			t.Errorf("release %s on a cluster: %d %s", key, status, body)
		}
		if err := h.locker.Extend(ctx, ls); !errors.Is(err, ErrLeaseLost) {
			t.Errorf("extending a force-released lease: %v, want ErrLeaseLost", err)
		}
		ls.Release()
	}
}

// TestAdminLockReplayView: a response stored by `replay` under
// <lockkey>:replay is reported (status, body size, expiry), without its
// headers (a stored Set-Cookie is a secret); without one, replay is null.
func TestAdminLockReplayView(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"keys":["{http.request.header.K}"],"replay":"1m","timeout":"5s"}`, r.Addr))
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		w.Header().Set("Set-Cookie", "session=s3cret")
		w.WriteHeader(http.StatusOK) // a GET's 201 would not be stored
		_, err := io.WriteString(w, "hello")
		return err
	})
	inspect := func(key string) (map[string]any, string) {
		t.Helper()
		w := httptest.NewRecorder()
		if err := h.inspectLock(w, httptest.NewRequest("GET", "/", nil), &shared.AdminEntry{Handler: h}, key); err != nil {
			t.Fatalf("inspect %s: %v", key, err)
		}
		var m map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		return m["servers"].([]any)[0].(map[string]any), w.Body.String()
	}
	if resp, body := get(t, srv.URL+"/", "K", "order-1"); resp == nil || resp.StatusCode != 200 || body != "hello" {
		t.Fatalf("first request: %v %q", resp, body)
	}
	// The answer is stored by the release, which runs just after the
	// response.
	var sv map[string]any
	var body string
	waitFor(5*time.Second, func() bool {
		sv, body = inspect("order-1")
		return sv["replay"] != nil
	})
	rv, _ := sv["replay"].(map[string]any)
	if rv == nil || rv["status"] != 200.0 || rv["size"] != 5.0 || rv["format"] != replayFormat {
		t.Errorf("stored replay: %s; want status 200, size 5, format %s", body, replayFormat)
	}
	if ms, _ := rv["expires_in_ms"].(float64); ms <= 0 || ms > 60000 {
		t.Errorf("replay expires in %vms, want (0, 60000]", rv["expires_in_ms"])
	}
	if strings.Contains(body, "s3cret") || strings.Contains(body, "hello") {
		t.Errorf("the lock view shows the stored response: %s", body)
	}
	// A value the plugin did not write is reported by its Redis type.
	r.Client().HSet(t.Context(), lock.ReplayKey(shared.StoredKey(h.Prefix, "odd")), "x", "y")
	if sv, body := inspect("odd"); sv["replay"] == nil || sv["replay"].(map[string]any)["format"] != "hash" || sv["replay"].(map[string]any)["status"] != nil {
		t.Errorf("a hash under :replay: %s", body)
	}
	r.Client().Set(t.Context(), lock.FenceKey(shared.StoredKey(h.Prefix, "n")), "7", time.Minute)
	if sv, body := inspect("n"); sv["replay"] != nil || sv["fencing_counter"] != 7.0 {
		t.Errorf("no replay: %s, want replay null and fencing counter 7", body)
	}
}

// TestAdminInspectAcrossUnregister: an admin call that found its handler
// just before a reload's Cleanup unregistered it still answers (with the
// servers it found). Before, the servers were looked up again, came back
// empty, and the index panicked in a goroutine, which ended the process; a
// panic inside the engine's fan-out is its server's error
// (internal/lock's TestOperatorCallsRecoverPanic).
func TestAdminInspectAcrossUnregister(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"name":"inspect-unregister","timeout":"2s"}`, r.Addr))
	rk := shared.StoredKey(h.Prefix, "k")
	ls, err := h.locker.Acquire(t.Context(), []string{rk})
	if err != nil {
		t.Fatal(err)
	}
	defer ls.Release()
	e := &shared.AdminEntry{Handler: h, Servers: []string{r.Addr}} // what FindHandler found, just before the Cleanup
	shared.UnregisterAdmin(h)                                      // what the old config's Cleanup does first
	w := httptest.NewRecorder()
	if err := h.inspectLock(w, httptest.NewRequest("GET", "/", nil), e, "k"); err != nil || !strings.Contains(w.Body.String(), `"held": true`) {
		t.Fatalf("inspect after unregister: %v %s", err, w.Body.String())
	}
}

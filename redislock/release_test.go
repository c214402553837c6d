package redislock

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
)

// TestAnswerDoesNotWaitForRelease: the client has its whole
// answer while the release is still on its way to Redis. Here Redis is
// paused as the upstream returns, so the release cannot be answered for
// 1.5s; the client's answer comes long before, and the lock is free soon
// after Redis answers again — on one server and on a Redlock.
func TestAnswerDoesNotWaitForRelease(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, rs []*testRedis, addrs string) {
		h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"5s","wait":"0s"}`, addrs))
		srv := handlerServer(t, h, func(w http.ResponseWriter, r *http.Request) error {
			if r.URL.Query().Get("pause") == "1" {
				for _, r := range rs {
					r.Pause()
				}
			}
			_, err := w.Write([]byte("done"))
			return err
		})
		start := time.Now()
		resp, body := get(t, srv.URL+"/rel?pause=1")
		took := time.Since(start)
		time.Sleep(1500 * time.Millisecond)
		for _, r := range rs {
			r.Resume()
		}
		if resp == nil || resp.StatusCode != 200 || body != "done" {
			t.Fatalf("answer: %v %q", resp, body)
		}
		if took > time.Second {
			t.Errorf("the answer took %s: it waited for the release (Redis paused for 1.5s)", took)
		}
		key := shared.StoredKey(h.Prefix, "/rel")
		if !freeWithin(3*time.Second, key, rs...) {
			t.Fatal("the lock is still held 3s after Redis answered again: the release was lost")
		}
	})
}

// TestSequentialRequestsNeverMeetTheirOwnRelease: a client's next request
// to the same instance, sent as soon as it has the answer, never finds the
// lock still held by its previous request, although that one is released
// after the answer: with wait 0, 100 requests in a row all get 200.
func TestSequentialRequestsNeverMeetTheirOwnRelease(t *testing.T) {
	t.Parallel()
	onOneAndThreeServers(t, func(t *testing.T, _ []*testRedis, addrs string) {
		h := provisionLock(t, fmt.Sprintf(`{"redis":%s,"timeout":"2s","wait":"0s"}`, addrs))
		srv := handlerServer(t, h, okHandler)
		for i := 0; i < 100; i++ {
			if resp, body := get(t, srv.URL+"/seq"); resp == nil || resp.StatusCode != 200 {
				t.Fatalf("request %d in a row: %v %q, want 200", i, resp, body)
			}
		}
	})
}

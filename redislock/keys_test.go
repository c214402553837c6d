package redislock

import (
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// TestKeyWithEmptyPlaceholder: a key in which one placeholder renders empty
// or unknown never becomes a shared key ("user:" for everyone without the
// header): the lock answers 400. (The rate limiter, which limits by client
// IP instead: the root's TestKeyWithEmptyPlaceholder.)
func TestKeyWithEmptyPlaceholder(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	lock := provisionLock(t, testkit.LockConfig(r.Addr, `"keys":["inventory:{http.request.uri.query.sku1}"],"wait":"0s"`))
	srv := handlerServer(t, lock, okHandler)
	if resp, _ := get(t, srv.URL+"/order?sku2=b"); resp == nil || resp.StatusCode != 400 {
		t.Errorf("lock key with an empty placeholder: status %v, want 400", resp)
	}
	if resp, _ := get(t, srv.URL+"/order?sku1=a"); resp == nil || resp.StatusCode != 200 {
		t.Errorf("lock key rendered whole: status %v, want 200", resp)
	}
}

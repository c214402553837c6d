package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// startCluster starts three redis-server masters in cluster mode on free
// loopback ports and joins them into one Cluster (no replicas).
func startCluster(t *testing.T) []*testRedis { return startClusterNodes(t, 3, 0) }

// TestClusterLockAndRateLimit: on a 3-master Redis Cluster, locks on keys
// spread over all slots are exclusive with increasing tokens (every script
// touches one slot: no CROSSSLOT), a request for several keys on different
// slots works, and the rate limiter counts exactly.
func TestClusterLockAndRateLimit(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	seeds := fmt.Sprintf(`["%s","%s"]`, rs[0].Addr, rs[1].Addr)
	up := testkit.NewExclusivityUpstream(time.Millisecond)
	a := provisionLock(t, fmt.Sprintf(`{"cluster":%s,"timeout":"2s","wait":"30s"}`, seeds))
	b := provisionLock(t, fmt.Sprintf(`{"cluster":%s,"timeout":"3s","wait":"30s"}`, seeds))
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
	getAllOK(t, 120, []string{sa.URL, sb.URL}, "k", 6)
	up.Check(t)
	// The six keys landed on more than one master.
	masters := 0
	for _, r := range rs {
		if n, _ := r.Client().DBSize(context.Background()).Result(); n > 0 {
			masters++
		}
	}
	if masters < 2 {
		t.Errorf("lock keys on %d masters; want them spread over the cluster", masters)
	}

	multi := provisionLock(t, fmt.Sprintf(`{"cluster":%s,"keys":["{http.request.header.A}","{http.request.header.B}"]}`, seeds))
	ms := handlerServer(t, multi, okHandler)
	for i := 0; i < 10; i++ {
		if resp, body := get(t, ms.URL+"/", "A", fmt.Sprint("x", i), "B", fmt.Sprint("y", i)); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("multi-key on cluster: %v %s", resp, body)
		}
	}

	rl := provisionRateLimitJSON(t, fmt.Sprintf(`{"cluster":%s,"timeout":"5s","key":"{http.request.header.U}","rates":[{"requests":3,"window":"1m"},{"requests":100,"window":"1h"}]}`, seeds))
	rls := handlerServer(t, rl, okHandler)
	for _, user := range []string{"u1", "u2", "u3"} {
		ok := 0
		for i := 0; i < 5; i++ {
			resp, _ := get(t, rls.URL+"/", "U", user)
			if resp != nil && resp.StatusCode == 200 {
				ok++
			} else if resp == nil || resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("rate limit on cluster: %v", resp)
			}
		}
		if ok != 3 {
			t.Errorf("user %s admitted %d of 5, want 3", user, ok)
		}
	}
}

package redisdlm

import (
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestLockSmoke(t *testing.T) {
	r := startRedis(t)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"]}`, r.Addr))
	var inflight, maxIn atomic.Int32
	srv := handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		n := inflight.Add(1)
		defer inflight.Add(-1)
		for {
			m := maxIn.Load()
			if n <= m || maxIn.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(5 * time.Millisecond)
		w.Header().Set("X-Fence", req.Header.Get("Lock-Fencing-Token"))
		return nil
	})
	var wg sync.WaitGroup
	var last int64
	var mu sync.Mutex
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, _ := get(t, srv.URL+"/k")
			if resp == nil || resp.StatusCode != 200 {
				t.Errorf("status %v", resp)
				return
			}
			f, _ := strconv.ParseInt(resp.Header.Get("X-Fence"), 10, 64)
			mu.Lock()
			if f > last {
				last = f
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	if maxIn.Load() != 1 {
		t.Fatalf("max in flight %d", maxIn.Load())
	}
	if last != 20 {
		t.Fatalf("last fence %d", last)
	}
}

package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// BenchmarkLockedRequest runs the handler's ServeHTTP in front of a
// `respond`-like next handler, 64 callers in parallel, each on keys of its
// own (uncontended), against one real Redis: with -benchmem, the
// allocations a locked request costs in Caddy (the HTTP server's own are
// left out), and a CPU profile of the handler alone. Speed figures come from
// make bench; this is the allocation and profile probe.
func BenchmarkLockedRequest(b *testing.B) {
	rs := startRedis(b)
	h := provisionLock(b, fmt.Sprintf(`{"redis":[%q]}`, rs.Addr))
	next := caddyhttp.HandlerFunc(okHandler)
	var callers atomic.Int64
	b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0))) // 64 callers
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		id := strconv.FormatInt(callers.Add(1), 10)
		for i := 0; pb.Next(); i++ {
			r := httptest.NewRequest("GET", "/k"+id+"-"+strconv.Itoa(i%16), nil)
			r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddyhttp.NewTestReplacer(r)))
			w := httptest.NewRecorder()
			w.Header().Set("Server", "Caddy") // as Caddy's server sets it before the handlers
			if err := h.ServeHTTP(w, r, next); err != nil || w.Code != http.StatusOK {
				b.Errorf("locked request: %d, %v", w.Code, err)
				return
			}
		}
	})
}

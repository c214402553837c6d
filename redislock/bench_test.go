package redislock

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// BenchmarkLockedRequest runs the handler's ServeHTTP in front of a
// `respond`-like next handler, 64 callers in parallel, each on keys of its
// own (uncontended), against one real Redis (sub-benchmark locked), and the
// same loop calling the next handler alone (respond): with -benchmem, the
// allocations a locked request costs in Caddy (the HTTP server's own are
// left out), and a CPU profile of the handler alone. cpu-µs/op is this
// process's CPU per request (the handler, the client side of Redis and the
// loop's own request building; Redis runs in its own process): locked −
// respond is what the handler adds, for comparing two builds of it run one
// after the other (it moves about 10% between runs on a 2-core machine).
// Speed figures come from make bench; this is the allocation and profile
// probe.
func BenchmarkLockedRequest(b *testing.B) {
	rs := startRedis(b)
	h := provisionLock(b, fmt.Sprintf(`{"redis":[%q]}`, rs.Addr))
	next := caddyhttp.HandlerFunc(okHandler)
	serve := map[string]func(http.ResponseWriter, *http.Request) error{
		"respond": next.ServeHTTP,
		"locked":  func(w http.ResponseWriter, r *http.Request) error { return h.ServeHTTP(w, r, next) },
	}
	for _, name := range []string{"respond", "locked"} {
		b.Run(name, func(b *testing.B) { benchRequests(b, serve[name]) })
	}
}

// benchRequests serves b.N requests with serve, 64 callers in parallel, each
// on paths of its own, and reports this process's CPU per request.
func benchRequests(b *testing.B, serve func(http.ResponseWriter, *http.Request) error) {
	var callers atomic.Int64
	b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0))) // 64 callers
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := processCPU()
	defer func() { b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op") }()
	b.RunParallel(func(pb *testing.PB) {
		id := strconv.FormatInt(callers.Add(1), 10)
		for i := 0; pb.Next(); i++ {
			r := httptest.NewRequest("GET", "/k"+id+"-"+strconv.Itoa(i%16), nil)
			r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddyhttp.NewTestReplacer(r)))
			w := httptest.NewRecorder()
			w.Header().Set("Server", "Caddy") // as Caddy's server sets it before the handlers
			if err := serve(w, r); err != nil || w.Code != http.StatusOK {
				b.Errorf("request: %d, %v", w.Code, err)
				return
			}
		}
	})
}

// processCPU is the CPU time this process used so far (user + system).
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

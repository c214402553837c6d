package redisdlm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The abuse figures of the README (measurements, so benchmarks: they run
// only when asked, and print what they measured):
//
//	go test -run '^$' -bench Abuse -benchtime 1x -v .

// serveDirect runs one request with header X-K: k through mw in front of
// next, the way Caddy's server would (replacer and vars in the context),
// and returns the status.
func serveDirect(mw caddyhttp.MiddlewareHandler, next caddyhttp.Handler, k string) int {
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-K", k)
	repl := caddyhttp.NewTestReplacer(r)
	ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{"client_ip": "192.0.2.1"})
	w := httptest.NewRecorder()
	if err := mw.ServeHTTP(w, r.WithContext(ctx), next); err != nil {
		if he, ok := err.(caddyhttp.HandlerError); ok {
			return he.StatusCode
		}
		return http.StatusInternalServerError
	}
	return w.Code
}

var okNext = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil })

// redisFigures reads the key count and used memory of r.
func redisFigures(tb testing.TB, r *testRedis) (keys, mem int64) {
	c := r.Client()
	ctx := context.Background()
	keys, err := c.DBSize(ctx).Result()
	if err != nil {
		tb.Fatal(err)
	}
	return keys, infoInt(tb, c, "memory", "used_memory")
}

// hammer sends n requests with distinct keys (prefix + i) from conc workers.
func hammer(mw caddyhttp.MiddlewareHandler, n, conc int, prefix string) map[int]int {
	var next atomic.Int64
	var mu sync.Mutex
	counts := map[int]int{}
	var wg sync.WaitGroup
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := map[int]int{}
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					break
				}
				local[serveDirect(mw, okNext, prefix+strconv.FormatInt(i, 10))]++
			}
			mu.Lock()
			for k, v := range local {
				counts[k] += v
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	return counts
}

// BenchmarkAbuseDistinctKeys: 100,000 distinct lock keys and 100,000
// distinct keys for each rate-limit algorithm from one client (short ttl
// and windows); Redis keys and memory before, at the peak, and after
// expiry, and how long the return to the baseline key count took.
func BenchmarkAbuseDistinctKeys(b *testing.B) {
	const n = 100000
	r := startRedis(b)
	lock := provisionLock(b, fmt.Sprintf(`{"redis":[%q],"ttl":"1s","wait":"0s","keys":["{http.request.header.X-K}"]}`, r.Addr))
	sw := provisionRateLimitJSON(b, fmt.Sprintf(`{"redis":[%q],"key":"{http.request.header.X-K}","rates":[{"requests":5,"window":"1s"}]}`, r.Addr))
	gcra := provisionRateLimitJSON(b, fmt.Sprintf(`{"redis":[%q],"key":"{http.request.header.X-K}","algorithm":"gcra","rates":[{"requests":5,"window":"1s"}]}`, r.Addr))
	for _, c := range []struct {
		name string
		mw   caddyhttp.MiddlewareHandler
	}{{"redis_lock ttl 1s", lock}, {"redis_ratelimit sliding_window 5/1s", sw}, {"redis_ratelimit gcra 5/1s", gcra}} {
		baseKeys, baseMem := redisFigures(b, r)
		start := time.Now()
		counts := hammer(c.mw, n, 16, "abuse-"+strings.Fields(c.name)[1]+"-")
		took := time.Since(start)
		peakKeys, peakMem := redisFigures(b, r)
		doneAt := time.Time{}
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			if k, _ := redisFigures(b, r); k <= baseKeys {
				doneAt = time.Now()
				break
			}
		}
		afterKeys, afterMem := redisFigures(b, r)
		back := "not within 60s"
		if !doneAt.IsZero() {
			back = doneAt.Sub(start.Add(took)).Round(100 * time.Millisecond).String()
		}
		b.Logf("%-36s %d keys in %s (answers %v): Redis keys before, at the last request, after expiry: %d, %d, %d; used_memory %.1f, %.1f, %.1f MB; back to the baseline key count %s after the last request",
			c.name, n, took.Round(100*time.Millisecond), counts, baseKeys, peakKeys, afterKeys,
			float64(baseMem)/1e6, float64(peakMem)/1e6, float64(afterMem)/1e6, back)
	}
}

// waiterRun sends conc requests at once for one hot key through h (the
// upstream holds each for hold) and samples goroutines and heap meanwhile.
func waiterRun(b *testing.B, h *redislock.RedisLock, conc int, hold time.Duration) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	baseG, baseHeap := runtime.NumGoroutine(), ms.HeapInuse
	var peakG atomic.Int64
	var peakHeap atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var m runtime.MemStats
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if g := int64(runtime.NumGoroutine()); g > peakG.Load() {
				peakG.Store(g)
			}
			runtime.ReadMemStats(&m)
			if m.HeapInuse > peakHeap.Load() {
				peakHeap.Store(m.HeapInuse)
			}
		}
	}()
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(hold)
		return nil
	})
	var mu sync.Mutex
	counts := map[int]int{}
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < conc; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := serveDirect(h, next, "hot")
			mu.Lock()
			counts[s]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	took := time.Since(start)
	close(stop)
	<-sampled
	answered := 0
	for _, v := range counts {
		answered += v
	}
	time.Sleep(500 * time.Millisecond)
	runtime.GC()
	runtime.ReadMemStats(&ms)
	b.Logf("%d waiters, max_waiters %d, hold %s: %d answered in %s %v; goroutines %d -> peak %d -> %d; heap in use %.1f -> peak %.1f -> %.1f MB",
		conc, h.MaxWaiters, hold, answered, took.Round(10*time.Millisecond), counts, baseG, peakG.Load(), runtime.NumGoroutine(),
		float64(baseHeap)/1e6, float64(peakHeap.Load())/1e6, float64(ms.HeapInuse)/1e6)
}

// BenchmarkAbuseHotKeyWaiters: 10,000 requests at once for one hot key,
// without and with max_waiters: every one is answered, and Caddy's
// goroutines and heap during and after the run.
func BenchmarkAbuseHotKeyWaiters(b *testing.B) {
	r := startRedis(b)
	for _, mw := range []int{0, 100} {
		h := provisionLock(b, fmt.Sprintf(`{"redis":[%q],"wait":"120s","max_waiters":%d,"keys":["{http.request.header.X-K}"]}`, r.Addr, mw))
		waiterRun(b, h, 10000, time.Millisecond)
	}
}

// BenchmarkAbuseLongHeaderKeys: 1,000 requests whose key is a distinct
// 64 KiB header: the Redis keys stay bounded (stored as SHA-256).
func BenchmarkAbuseLongHeaderKeys(b *testing.B) {
	r := startRedis(b)
	lock := provisionLock(b, fmt.Sprintf(`{"redis":[%q],"ttl":"30s","keys":["{http.request.header.X-K}"]}`, r.Addr))
	rl := provisionRateLimitJSON(b, fmt.Sprintf(`{"redis":[%q],"key":"{http.request.header.X-K}","rates":[{"requests":5,"window":"1m"}]}`, r.Addr))
	raw := make([]byte, 32*1024)
	for _, c := range []struct {
		name string
		mw   caddyhttp.MiddlewareHandler
	}{{"redis_lock", lock}, {"redis_ratelimit", rl}} {
		baseKeys, baseMem := redisFigures(b, r)
		counts := map[int]int{}
		for i := 0; i < 1000; i++ {
			_, _ = rand.Read(raw)
			counts[serveDirect(c.mw, okNext, hex.EncodeToString(raw))]++ // 64 KiB of hex
		}
		keys, mem := redisFigures(b, r)
		longest := 0
		iter := r.Client().Scan(context.Background(), 0, "*", 1000).Iterator()
		for iter.Next(context.Background()) {
			longest = max(longest, len(iter.Val()))
		}
		b.Logf("%-16s 1000 keys of 64 KiB (answers %v): Redis keys %d -> %d, longest key name %d bytes, used_memory %.2f -> %.2f MB (%.0f bytes per request)",
			c.name, counts, baseKeys, keys, longest, float64(baseMem)/1e6, float64(mem)/1e6, float64(mem-baseMem)/1000)
	}
}

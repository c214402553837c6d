package redislock

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
)

// BenchmarkLockAcquireRelease measures one uncontended acquire + release at
// library level (no HTTP), on one server and on a Redlock quorum of three,
// and reports the median (p50-us) beside the mean. make bench prints the
// ratio of the medians.
func BenchmarkLockAcquireRelease(b *testing.B) {
	for _, n := range []int{1, 3} {
		b.Run("servers="+strconv.Itoa(n), func(b *testing.B) {
			addrs := ""
			for i := 0; i < n; i++ {
				if i > 0 {
					addrs += ","
				}
				addrs += `"` + startRedis(b).Addr + `"`
			}
			h := provisionLock(b, fmt.Sprintf(`{"redis":[%s],"wait":0}`, addrs))
			ctx := context.Background()
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				start := time.Now()
				ls, err := h.locker.Acquire(ctx, []string{shared.StoredKey(h.Prefix, "k"+strconv.Itoa(i))})
				if err != nil {
					b.Fatal(err)
				}
				ls.Release()
				lat = append(lat, time.Since(start))
			}
			b.StopTimer()
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-us")
		})
	}
}

package ratelimit

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// BenchmarkRateLimitMemoryPerKey measures the Redis memory of one limit key
// with MEMORY USAGE, after filling it through the real scripts. It prints
// the figures quoted in the README (a measurement, so a benchmark: it runs
// only when asked):
//
//	go test -run '^$' -bench RateLimitMemoryPerKey -benchtime 1x -v ./internal/ratelimit/
func BenchmarkRateLimitMemoryPerKey(b *testing.B) {
	measureRateLimitMemory(b)
}

func measureRateLimitMemory(t testing.TB) {
	r := testredis.Start(t)
	c := r.Client()
	ctx := context.Background()
	hour := time.Hour.Microseconds()
	usage := func(key string) int64 {
		n, err := c.MemoryUsage(ctx, key, 0).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if err := c.ScriptLoad(ctx, slidingScript.Source()).Err(); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 10, 100, 1000, 10000, 100000} {
		key := fmt.Sprintf("caddy:rl:{203.0.113.7}:sw:%d/1h0m0s", n)
		for done := 0; done < n; {
			pipe := c.Pipeline()
			batch := min(1000, n-done)
			for i := 0; i < batch; i++ {
				decideOnce(ctx, pipe, slidingScript, []string{key}, 1, 0, 0, n, hour)
			}
			if _, err := pipe.Exec(ctx); err != nil {
				t.Fatal(err)
			}
			done += batch
		}
		// The log's header starts with its count of admissions.
		if hdr, err := c.GetRange(ctx, key, 0, 7).Bytes(); err != nil || len(hdr) != 8 || math.Float64frombits(binary.BigEndian.Uint64(hdr)) != float64(n) {
			t.Fatalf("filled %x (%v), want %d admissions", hdr, err, n)
		}
		b := usage(key)
		t.Logf("sliding_window n=%-6d full key: %8d bytes (%.1f bytes per admission)", n, b, float64(b)/float64(n))
	}
	key := "caddy:rl:{203.0.113.7}:gcra:100/1h0m0s:b100"
	if err := decideOnce(ctx, c, gcraScript, []string{key}, 1, 0, 0, 100, hour, 100).Err(); err != nil {
		t.Fatal(err)
	}
	t.Logf("gcra any n: %d bytes", usage(key))
}

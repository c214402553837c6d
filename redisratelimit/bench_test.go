package redisratelimit

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// BenchmarkRateLimitDecision: decisions per second through the handler
// (batched script calls), many keys, none rejected; compare with
// BenchmarkRedisIncr, one plain INCR per operation through go-redis.
func BenchmarkRateLimitDecision(b *testing.B) {
	r := startRedis(b)
	h := &RedisRateLimit{Rates: []Rate{{Requests: 100_000, Window: caddy.Duration(time.Minute)}}}
	h.Addresses = []string{r.Addr}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := h.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	defer h.Cleanup()
	h.logger = zap.NewNop() // measure decisions, not debug logging
	var n atomic.Int64
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			ip := fmt.Sprintf("10.0.%d.%d", n.Add(1)%200, 1)
			if a := serveRL(h, ip, nil); !a.passed || a.err != nil {
				b.Errorf("status %d err %v", a.status, a.err)
				return
			}
		}
	})
}

func BenchmarkRedisIncr(b *testing.B) {
	r := startRedis(b)
	c := r.Client()
	var n atomic.Int64
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := c.Incr(context.Background(), fmt.Sprintf("k%d", n.Add(1)%200)).Err(); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkRateLimitDecide: the Redis part of a decision only.
func BenchmarkRateLimitDecide(b *testing.B) {
	r := startRedis(b)
	h := &RedisRateLimit{Rates: []Rate{{Requests: 100_000, Window: caddy.Duration(time.Minute)}}}
	h.Addresses = []string{r.Addr}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := h.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	defer h.Cleanup()
	defer func() {
		info, _ := r.Client().Info(context.Background(), "commandstats").Result()
		for _, l := range strings.Split(info, "\n") {
			if strings.Contains(l, "eval") || strings.Contains(l, "getrange") {
				b.Log(strings.TrimSpace(l))
			}
		}
	}()
	var n atomic.Int64
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			d, err := h.decide(context.Background(), fmt.Sprintf("10.0.%d.1", n.Add(1)%200), &h.static)
			if err != nil || !d.Allowed {
				b.Errorf("%v %v", d, err)
				return
			}
		}
	})
}

package redisdlm

import (
	"context"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/redis/go-redis/v9"
)

// waitFor polls cond every 5ms until it holds or d has passed; startRedlock
// starts n independent redis-servers and returns them with the JSON list of
// their addresses (internal/testredis).
var (
	waitFor      = testredis.WaitFor
	startRedlock = testredis.StartRedlock
)

// The lock's test helpers that the root's tests of a whole Caddy or of the
// lock with another module share (the root reaches the lock through its
// exported API only; what redislock's tests use as well is in
// internal/testkit).

// lostCount reads caddy_redis_lock_lost_total of one handler.
func lostCount(handler string) float64 {
	return testkit.Count(shared.LockLostTotal.WithLabelValues(handler))
}

// heldBy reports how many holders a lock key has on r.
func heldBy(r *testRedis, key string) int64 {
	n, _ := r.Client().ZCard(context.Background(), key).Result()
	return n
}

// lockClient is the pooled Redis client of a provisioned lock handler on
// one logical Redis: the pool names a client by its connection settings.
func lockClient(t *testing.T, h *redislock.RedisLock) redis.UniversalClient {
	t.Helper()
	settings, err := h.RedisConfig.Resolve()
	if err != nil || len(settings) != 1 {
		t.Fatalf("the lock's connection settings: %v %v", settings, err)
	}
	return testkit.PooledFor(t, settings[0].PoolKey()).Redis
}

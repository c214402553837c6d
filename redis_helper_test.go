package redisdlm

import (
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// testRedis is a real redis-server process for one test (internal/testredis).
type testRedis = testredis.Server

// startRedis starts redis-server; extra args are passed as config
// (e.g. "--requirepass", "secret"). It fails the test loudly when
// redis-server is not installed.
func startRedis(t testing.TB, args ...string) *testRedis {
	t.Helper()
	return testredis.Start(t, args...)
}

// startRedisOnPort starts a server on a port chosen before (to test "Redis
// comes up after Caddy").
func startRedisOnPort(t testing.TB, port int, args ...string) *testRedis {
	t.Helper()
	return testredis.StartOnPort(t, port, args...)
}

// freePort returns a free loopback port (testredis.FreePort).
func freePort(t testing.TB) int {
	t.Helper()
	return testredis.FreePort(t)
}

// startSentinels starts n sentinels that monitor master as "mymaster"
// (testredis.StartSentinels).
func startSentinels(t *testing.T, master *testRedis, n, quorum, replicas int, downAfter time.Duration) []string {
	t.Helper()
	return testredis.StartSentinels(t, master, testredis.SentinelOptions{Count: n, Quorum: quorum, Replicas: replicas, DownAfter: downAfter})
}

// startReplica starts a replica of master and waits until its link is up.
func startReplica(t *testing.T, master *testRedis) *testRedis {
	t.Helper()
	return testredis.StartReplica(t, master)
}

// startClusterNodes starts a Redis Cluster of masters masters with
// replicas replicas each (testredis.StartCluster).
func startClusterNodes(t *testing.T, masters, replicas int) []*testRedis {
	t.Helper()
	return testredis.StartCluster(t, masters, replicas)
}

// infoInt reads one integer field of an INFO section through c.
func infoInt(tb testing.TB, c *redis.Client, section, field string) int64 {
	tb.Helper()
	return testredis.InfoInt(tb, c, section, field)
}

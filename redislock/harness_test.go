package redislock

import (
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) { testkit.Main(m) }

// provisionLock builds a redis_lock handler from its JSON form, provisions
// it like Caddy would, quiets its logger, and cleans it up when the test
// ends.
func provisionLock(t testing.TB, cfg string) *RedisLock {
	t.Helper()
	h := new(RedisLock)
	testkit.Provision(t, cfg, h)
	quietLock(h)
	return h
}

// quietLock replaces the debug logger that Caddy gives a module
// provisioned without a config (as in these tests) by testkit.QuietLogger.
func quietLock(h *RedisLock) {
	h.logger = testkit.QuietLogger()
	h.locker.SetLogger(shared.SlogFor(h.logger))
}

// lockInstanceID is the handler's instance id in the lock's Redis wait lists.
func lockInstanceID(h *RedisLock) string { return h.locker.InstanceID() }

// testRedis is a real redis-server process for one test (internal/testredis).
type testRedis = testredis.Server

// startRedis starts redis-server (extra args are passed as config, e.g.
// "--requirepass", "secret"); startRedisOnPort starts one on a port chosen
// before (to test "Redis comes up after Caddy"); freePort is a free
// loopback port; infoInt reads one integer field of an INFO section
// (internal/testredis). handlerServer serves mw in front of next the way
// Caddy's server does; okHandler answers 200; get sends one GET with a
// bounded client (internal/testkit).
var (
	startRedis       = testredis.Start
	startRedisOnPort = testredis.StartOnPort
	freePort         = testredis.FreePort
	infoInt          = testredis.InfoInt
	handlerServer    = testkit.Serve
	okHandler        = testkit.OK
	get              = testkit.Get
)

// startSentinel starts a redis-server in sentinel mode that monitors master
// under the name "mymaster", and returns its address.
func startSentinel(t *testing.T, master *testRedis) string {
	t.Helper()
	return testredis.StartSentinels(t, master, testredis.SentinelOptions{Count: 1, Quorum: 1, DownAfter: 5 * time.Second})[0]
}

// startCluster starts three redis-server masters in cluster mode on free
// loopback ports and joins them into one Cluster (no replicas).
func startCluster(t *testing.T) []*testRedis {
	t.Helper()
	return testredis.StartCluster(t, 3, 0)
}

// startClusterNode starts one redis-server in cluster mode, on its own.
func startClusterNode(t *testing.T) *testRedis { return testredis.StartClusterNode(t) }

// redisZ is a sorted-set member scored as a lease end in ms (the lock
// scripts' format).
func redisZ(until time.Time, member string) redis.Z {
	return redis.Z{Score: float64(until.UnixMilli()), Member: member}
}

// secretPW is a Redis password that must never appear in an error or a log.
const secretPW = "hunter2x"

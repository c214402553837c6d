package redisdlm

import (
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// testRedis is a real redis-server process for one test (internal/testredis).
type testRedis = testredis.Server

// startRedis starts redis-server (extra args are passed as config, e.g.
// "--requirepass", "secret") and fails the test loudly when it is not
// installed; startRedisOnPort starts one on a port chosen before (to test
// "Redis comes up after Caddy"); freePort is a free loopback port; infoInt
// reads one integer field of an INFO section (internal/testredis).
var (
	startRedis       = testredis.Start
	startRedisOnPort = testredis.StartOnPort
	freePort         = testredis.FreePort
	infoInt          = testredis.InfoInt
)

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

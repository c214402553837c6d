package testredis

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestReplicaAndSentinel: a replica syncs with its master, and a sentinel
// names the master.
func TestReplicaAndSentinel(t *testing.T) {
	t.Parallel()
	master := Start(t)
	StartReplica(t, master)
	addrs := StartSentinels(t, master, SentinelOptions{Count: 1, Quorum: 1, Replicas: 1, DownAfter: 5 * time.Second})
	if len(addrs) != 1 || !strings.HasPrefix(addrs[0], "127.0.0.1:") {
		t.Fatalf("sentinels at %v, want one on loopback", addrs)
	}
}

// TestCluster: three masters form one Cluster with every slot served.
func TestCluster(t *testing.T) {
	t.Parallel()
	rs := StartCluster(t, 3, 0)
	info, err := rs[0].Client().ClusterInfo(context.Background()).Result()
	if err != nil || !strings.Contains(info, "cluster_slots_assigned:16384") {
		t.Fatalf("cluster info %q %v, want all 16384 slots assigned", info, err)
	}
}

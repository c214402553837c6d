package testredis

// Servers that take more than one redis-server: replicas, Sentinels and a
// Cluster.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelOptions describe the sentinels of StartSentinels.
type SentinelOptions struct {
	Count     int           // sentinels
	Quorum    int           // sentinels that must agree the master is down
	Replicas  int           // replicas of the master each must know before StartSentinels returns
	DownAfter time.Duration // down-after-milliseconds
}

// StartSentinels starts o.Count sentinels that monitor master as
// "mymaster" with quorum o.Quorum, declare it down after o.DownAfter, and
// know each other and the master's o.Replicas replicas before it returns.
func StartSentinels(t testing.TB, master *Server, o SentinelOptions) []string {
	n, quorum, replicas, downAfter := o.Count, o.Quorum, o.Replicas, o.DownAfter
	t.Helper()
	var addrs []string
	for i := 0; i < n; i++ {
		dir := t.TempDir()
		port := FreePort(t)
		cfg := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\n"+
			"sentinel monitor mymaster 127.0.0.1 %d %d\n"+
			"sentinel down-after-milliseconds mymaster %d\nsentinel failover-timeout mymaster 5000\nsentinel parallel-syncs mymaster 1\n",
			port, dir, filepath.Join(dir, "sentinel.log"), master.Port, quorum, downAfter.Milliseconds())
		conf := filepath.Join(dir, "sentinel.conf")
		if err := os.WriteFile(conf, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("redis-server", conf, "--sentinel")
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting sentinel: %v", err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		addrs = append(addrs, fmt.Sprintf("127.0.0.1:%d", port))
	}
	deadline := time.Now().Add(40 * time.Second)
	for _, a := range addrs {
		c := redis.NewSentinelClient(&redis.Options{Addr: a, DialTimeout: time.Second, ReadTimeout: time.Second})
		for {
			m, err := c.GetMasterAddrByName(context.Background(), "mymaster").Result()
			reps, _ := c.Replicas(context.Background(), "mymaster").Result()
			peers, _ := c.Sentinels(context.Background(), "mymaster").Result()
			if err == nil && len(m) == 2 && len(reps) >= replicas && len(peers) >= n-1 {
				break
			}
			if time.Now().After(deadline) {
				c.Close()
				t.Fatalf("sentinel %s knows %d replicas and %d other sentinels; want %d and %d", a, len(reps), len(peers), replicas, n-1)
			}
			time.Sleep(100 * time.Millisecond)
		}
		c.Close()
	}
	return addrs
}

// StartReplica starts a replica of master and waits until its link is up.
func StartReplica(t testing.TB, master *Server) *Server {
	t.Helper()
	r := Start(t, "--replicaof", "127.0.0.1", strconv.Itoa(master.Port))
	if !WaitFor(20*time.Second, func() bool {
		info, _ := r.Client().Info(context.Background(), "replication").Result()
		return strings.Contains(info, "master_link_status:up")
	}) {
		t.Fatal("replica did not sync with the master")
	}
	return r
}

// StartCluster starts a Redis Cluster of masters masters with
// replicas replicas each, on free loopback ports, and waits until every
// node sees it whole and ok (or a client may meet CLUSTERDOWN at first).
// It joins the nodes itself (slots, epochs, MEET, REPLICATE), as
// redis-cli --cluster create does, but polls instead of sleeping seconds.
func StartCluster(t testing.TB, masters, replicas int) []*Server {
	t.Helper()
	ctx := context.Background()
	var rs []*Server
	for i := 0; i < masters*(1+replicas); i++ {
		rs = append(rs, StartClusterNode(t))
	}
	do := func(r *Server, args ...any) {
		t.Helper()
		if err := r.Client().Do(ctx, args...).Err(); err != nil {
			t.Fatalf("%v on %s: %v", args, r, err)
		}
	}
	ids := make([]string, len(rs))
	for i, r := range rs {
		id, err := r.Client().Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatalf("CLUSTER MYID on %s: %v", r, err)
		}
		ids[i] = id
		do(r, "CLUSTER", "SET-CONFIG-EPOCH", i+1)
		if i < masters {
			do(r, "CLUSTER", "ADDSLOTSRANGE", i*16384/masters, (i+1)*16384/masters-1)
		}
	}
	for _, r := range rs[1:] {
		do(rs[0], "CLUSTER", "MEET", "127.0.0.1", r.Port)
	}
	known := fmt.Sprintf("cluster_known_nodes:%d", len(rs))
	waitInfo := func(r *Server, want ...string) {
		t.Helper()
		c := r.Client()
		if !WaitFor(40*time.Second, func() bool {
			info, _ := c.ClusterInfo(ctx).Result()
			for _, w := range want {
				if !strings.Contains(info, w) {
					return false
				}
			}
			return true
		}) {
			t.Fatalf("cluster node %s: CLUSTER INFO never showed %v", r.Addr, want)
		}
	}
	for i, r := range rs[masters:] {
		waitInfo(r, known) // it knows its master's id
		do(r, "CLUSTER", "REPLICATE", ids[i%masters])
	}
	for _, r := range rs {
		waitInfo(r, "cluster_state:ok", known)
	}
	return rs
}

// StartClusterNode starts one redis-server in cluster mode, on its own.
func StartClusterNode(t testing.TB) *Server {
	return Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
}

package redislock

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/redis/go-redis/v9"
)

// waitReplicaOnline waits until master reports n online replicas.
func waitReplicaOnline(t *testing.T, master *redis.Client, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, _ := master.Info(context.Background(), "replication").Result()
		if strings.Count(info, "state=online") >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica not online in time: %s", info)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// until200 asks url every 100ms until it answers 200, and fails the test
// when that takes longer than within.
func until200(t *testing.T, url string, within time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, body := get(t, url)
		if resp != nil && resp.StatusCode == 200 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v %q, want 200 within %s", what, resp, body, within)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestSyncReplicas: with a real primary and replica, sync_replicas 1
// grants while the replica acknowledges; with the replica paused the lock
// answers 503 saying how many replicas acknowledged (WAIT ends before the
// read timeout), and the grant is released at once, not left for the ttl.
func TestSyncReplicas(t *testing.T) {
	t.Parallel()
	primary := startRedis(t)
	replica := startRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	pc := primary.Client()
	waitReplicaOnline(t, pc, 1)
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"sync_replicas":1,"wait":"0s","ttl":"30s","timeout":"2s"}`, primary.Addr))
	srv := handlerServer(t, h, okHandler)

	if resp, body := get(t, srv.URL+"/a"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("replica running: %v %q, want 200", resp, body)
	}
	replica.Pause()
	resp, body := get(t, srv.URL+"/b")
	if resp == nil || resp.StatusCode != 503 || !strings.Contains(body, "sync_replicas: 0 of 1 replicas acknowledged the lock") {
		t.Errorf("replica paused: %v %q, want 503 with \"0 of 1 replicas acknowledged\"", resp, body)
	}
	if n, _ := pc.ZCard(context.Background(), shared.StoredKey(h.Prefix, "/b")).Result(); n != 0 {
		ttl, _ := pc.PTTL(context.Background(), shared.StoredKey(h.Prefix, "/b")).Result()
		t.Errorf("a lease whose WAIT failed is left behind (%d holders, ttl %s)", n, ttl)
	}
	replica.Resume()
	until200(t, srv.URL+"/c", 10*time.Second, "after the replica resumed")
}

// TestSyncReplicasCluster: on a Cluster, WAIT runs on the key's own master.
// Only the master of key "a" has a replica, so "a" is granted every time and
// a key on another master is refused every time (with WAIT sent to a random
// master, both would be a coin toss). Then that replica is paused: "a" gets
// 503 "0 of 1 replicas acknowledged" within the bounded WAIT, holds nothing
// on its master afterwards, and is granted again once the replica resumes.
func TestSyncReplicasCluster(t *testing.T) {
	t.Parallel()
	rs := startCluster(t)
	seeds := fmt.Sprintf(`["%s","%s","%s"]`, rs[0].Addr, rs[1].Addr, rs[2].Addr)
	h := provisionLock(t, fmt.Sprintf(`{"cluster":%s,"sync_replicas":1,"wait":"0s","timeout":"2s"}`, seeds))
	srv := handlerServer(t, h, okHandler)

	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{rs[0].Addr}})
	t.Cleanup(func() { cc.Close() })
	ctx := context.Background()
	masterOf := func(path string) *redis.Client {
		m, err := cc.MasterForKey(ctx, shared.StoredKey(h.Prefix, path))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	ma := masterOf("/a")
	other := ""
	for i := 0; i < 100 && other == ""; i++ {
		if p := fmt.Sprintf("/b%d", i); masterOf(p).Options().Addr != ma.Options().Addr {
			other = p
		}
	}
	id, err := ma.Do(ctx, "cluster", "myid").Text()
	if err != nil {
		t.Fatal(err)
	}
	replica := startClusterNode(t)
	// Join it as a replica of ma (what redis-cli --cluster add-node
	// --cluster-slave does, polling instead of sleeping seconds).
	rc := replica.Client()
	if err := rc.Do(ctx, "CLUSTER", "MEET", "127.0.0.1", rs[0].Port).Err(); err != nil {
		t.Fatal(err)
	}
	if !waitFor(30*time.Second, func() bool {
		return rc.Do(ctx, "CLUSTER", "REPLICATE", id).Err() == nil // once it knows ma
	}) {
		t.Fatal("the new node never learned the master's id")
	}
	waitReplicaOnline(t, ma, 1)

	for i := 0; i < 3; i++ {
		if resp, body := get(t, srv.URL+"/a"); resp == nil || resp.StatusCode != 200 {
			t.Errorf("key on the master with a replica, try %d: %v %q, want 200", i, resp, body)
		}
		resp, body := get(t, srv.URL+other)
		if resp == nil || resp.StatusCode != 503 || !strings.Contains(body, "0 of 1 replicas acknowledged") {
			t.Errorf("key on a master without a replica, try %d: %v %q, want 503 with \"0 of 1 replicas acknowledged\"", i, resp, body)
		}
	}
	// noHolder: the lock key of path has no holder (and no queued instance)
	// on its master; a release whose outcome was unknown may still run in
	// the background, so it polls for up to 2s.
	noHolder := func(path, what string) {
		t.Helper()
		m, k := masterOf(path), shared.StoredKey(h.Prefix, path)
		var holders, queued int64
		if !waitFor(2*time.Second, func() bool {
			holders, _ = m.ZCard(ctx, k).Result()
			queued, _ = m.ZCard(ctx, lock.WaitqKey(k)).Result()
			return holders == 0 && queued == 0
		}) {
			ttl, _ := m.PTTL(ctx, k).Result()
			t.Errorf("%s: %s left %d holders (ttl %s), %d queued on %s", what, k, holders, ttl, queued, m.Options().Addr)
		}
	}
	noHolder(other, "key on a master without a replica")

	replica.Pause()
	t.Cleanup(replica.Resume)
	start := time.Now()
	resp, body := get(t, srv.URL+"/a")
	took := time.Since(start)
	if resp == nil || resp.StatusCode != 503 || !strings.Contains(body, "sync_replicas: 0 of 1 replicas acknowledged the lock") {
		t.Errorf("the master's replica paused: %v %q, want 503 with \"0 of 1 replicas acknowledged\"", resp, body)
	}
	// WAIT gives up after timeout/2 (1s); the pipeline may take 2*timeout.
	if took > 5*time.Second {
		t.Errorf("the master's replica paused: the 503 took %s, want at most 5s (WAIT gives up after 1s)", took)
	}
	noHolder("/a", "the master's replica paused")
	resp, body = get(t, srv.URL+other)
	if resp == nil || resp.StatusCode != 503 || !strings.Contains(body, "0 of 1 replicas acknowledged") {
		t.Errorf("key on a master without a replica, replica of /a paused: %v %q, want 503", resp, body)
	}
	noHolder(other, "key on a master without a replica, replica of /a paused")

	replica.Resume()
	until200(t, srv.URL+"/a", 10*time.Second, "the master's replica resumed")
	noHolder("/a", "the master's replica resumed, lock released")
}

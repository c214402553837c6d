package lock

// Calls Redis answers with an error: refused without running (a read-only
// replica, over maxmemory) they held nothing; raised while the script ran,
// they may have written.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// makeReadOnly turns r into a replica of a master that does not exist: it
// refuses every write (READONLY), scripts included.
func makeReadOnly(t *testing.T, r *testredis.Server) {
	t.Helper()
	if err := r.Client().Do(context.Background(), "replicaof", "127.0.0.1", fmt.Sprint(testredis.FreePort(t))).Err(); err != nil {
		t.Fatal(err)
	}
}

// fillRedis writes 2 MiB and sets maxmemory 256 KiB below the memory then
// used, so the server (noeviction) is clearly over its limit.
func fillRedis(t *testing.T, r *testredis.Server) {
	t.Helper()
	ctx, c := context.Background(), r.Client()
	v := strings.Repeat("x", 1024)
	for i := 0; i < 2048; i += 128 {
		pipe := c.Pipeline()
		for j := i; j < i+128; j++ {
			pipe.Set(ctx, fmt.Sprintf("fill:%d", j), v, 0)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatalf("filling redis: %v", err)
		}
	}
	info := c.Info(ctx, "memory").Val()
	var mem int64
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			mem, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	if mem == 0 {
		t.Fatalf("no used_memory in INFO memory: %q", info)
	}
	if err := c.ConfigSet(ctx, "maxmemory", strconv.FormatInt(mem-256<<10, 10)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, "probe", "x", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "OOM") {
		t.Fatalf("a write over maxmemory answered %v, want OOM", err)
	}
}

// TestRefusedAcquiresCountNoReleaseFailure: acquires that Redis refused
// with an answer (a read-only replica, or over maxmemory) held nothing:
// nothing is released for them, so no release failure is counted and no
// release is left pending. Before, each refused acquire was undone by a
// release that was refused too: 64 refused acquires counted 64 release
// failures, each retried for 2 × ttl + 10s.
func TestRefusedAcquiresCountNoReleaseFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		servers int
		refuse  func(t *testing.T, rs []*testredis.Server)
	}{
		{"read-only replica", 1, func(t *testing.T, rs []*testredis.Server) { makeReadOnly(t, rs[0]) }},
		{"over maxmemory", 1, func(t *testing.T, rs []*testredis.Server) { fillRedis(t, rs[0]) }},
		{"redlock, two read-only members", 3, func(t *testing.T, rs []*testredis.Server) { makeReadOnly(t, rs[0]); makeReadOnly(t, rs[1]) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rs := make([]*testredis.Server, tc.servers)
			for i := range rs {
				rs[i] = testredis.Start(t, "--maxmemory-policy", "noeviction")
			}
			o := testOptions()
			o.TTL = 2 * time.Second
			l, _ := testLocker(t, rs, o)
			var failures atomic.Int32
			for _, s := range l.servers {
				s.OnReleaseFailure(func(string) { failures.Add(1) })
			}
			tc.refuse(t, rs)
			keys := make([]string, 64)
			for i := range keys {
				keys[i] = fmt.Sprintf("caddy:lock:{/k%d}", i)
				if _, err := l.Acquire(context.Background(), []string{keys[i]}); !errors.Is(err, ErrUnavailable) {
					t.Fatalf("acquire %d refused by redis: %v, want ErrUnavailable", i, err)
				}
			}
			// Late answers and their undos: a member that granted gives
			// each grant back.
			for _, k := range keys {
				if !allFree(5*time.Second, k, rs) {
					t.Fatalf("%s is still held after its acquire was refused", k)
				}
			}
			if n := failures.Load(); n != 0 {
				t.Errorf("64 refused acquires counted %d release failures, want 0", n)
			}
			for i, s := range l.servers {
				if n := s.rel.pendingCount(); n != 0 {
					t.Errorf("server %d: %d releases pending for acquires that held nothing", i, n)
				}
			}
		})
	}
}

// TestScriptErrorAfterWritesIsUndone: an acquire that Redis answered with
// an error raised while the script ran (here the key's fencing counter is
// of the wrong type, after the script took the lock) may have written: it
// is undone, unlike a call Redis refused without running it.
func TestScriptErrorAfterWritesIsUndone(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	l, _ := testLocker(t, rs, testOptions())
	key := "caddy:lock:{/wrongtype}"
	rs[0].Client().HSet(context.Background(), FenceKey(key), "not", "a counter")
	_, err := l.Acquire(context.Background(), []string{key})
	if err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("acquire with a fencing counter of the wrong type: %v, want the WRONGTYPE error", err)
	}
	if !allFree(2*time.Second, key, rs) {
		t.Fatal("the lock taken before the script's error is still held")
	}
}

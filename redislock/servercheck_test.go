package redislock

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// observeChecks makes the server checks of h's clients log to an observer.
func observeChecks(t *testing.T, h *RedisLock) *observer.ObservedLogs {
	t.Helper()
	core, logs := observer.New(zapcore.WarnLevel)
	for _, k := range h.poolKeys {
		testkit.PooledFor(t, k).Check.SetLogger(shared.SlogFor(zap.New(core)))
	}
	return logs
}

// hammerURL sends n concurrent requests for distinct keys (so the client
// opens several connections) and returns the statuses seen.
func hammerURL(t *testing.T, url string, n int) map[int]int {
	t.Helper()
	var mu sync.Mutex
	seen := map[int]int{}
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			resp, body := get(t, fmt.Sprintf("%s/k%d", url, i))
			if resp != nil && resp.StatusCode != 200 {
				t.Logf("request %d: %d %s", i, resp.StatusCode, body)
			}
			if resp != nil {
				mu.Lock()
				seen[resp.StatusCode]++
				mu.Unlock()
			}
		}(i)
	}
	wg.Wait()
	return seen
}

func gaugeValue(g interface{ Write(*dto.Metric) error }) float64 {
	var m dto.Metric
	_ = g.Write(&m)
	return m.GetGauge().GetValue()
}

func isEvicting(sc *redisconn.Check, addr string) bool { return shared.Evicting(sc, addr) }

// TestServerCheckEvictingPolicy: on the first connection to a server with an
// evicting maxmemory-policy, one error log names the server and the policy
// (once per server, not per connection) and the server counts in
// caddy_redis_evicting_servers until its client is closed; noeviction
// logs nothing. Locks still work: the check warns, it does not refuse.
func TestServerCheckEvictingPolicy(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{"allkeys-lru", "volatile-lru", "noeviction"} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t, "--maxmemory", "64mb", "--maxmemory-policy", policy)
			h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"0s","timeout":"2s"}`, r.Addr))
			logs := observeChecks(t, h)
			pc := testkit.PooledFor(t, h.poolKeys[0])
			srv := handlerServer(t, h, okHandler)
			if seen := hammerURL(t, srv.URL, 20); seen[200] != 20 {
				t.Fatalf("statuses %v, want 20 × 200", seen)
			}
			errs := logs.FilterMessageSnippet("evicts keys").All()
			if policy == "noeviction" {
				if len(errs) != 0 || isEvicting(pc.Check, r.Addr) {
					t.Fatalf("noeviction: logged %v, gauge entry %v", errs, isEvicting(pc.Check, r.Addr))
				}
				return
			}
			if len(errs) != 1 {
				t.Fatalf("%d error logs about eviction, want exactly 1 (once per server): %v", len(errs), logs.All())
			}
			f := errs[0].ContextMap()
			if errs[0].Level != zapcore.ErrorLevel || f["server"] != r.Addr || f["maxmemory_policy"] != policy {
				t.Errorf("log %s %q %v: want error level naming server %s and policy %s", errs[0].Level, errs[0].Message, f, r.Addr, policy)
			}
			gauge := shared.EvictingServers.WithLabelValues(h.label)
			if !isEvicting(pc.Check, r.Addr) || gaugeValue(gauge) != 1 {
				t.Errorf("server not counted in caddy_redis_evicting_servers{handler=%q} (gauge %v)", h.label, gaugeValue(gauge))
			}
			pc.Check.Close()
			if isEvicting(pc.Check, r.Addr) || gaugeValue(gauge) != 0 {
				t.Errorf("a closed client's server still counts as evicting (gauge %v)", gaugeValue(gauge))
			}
		})
	}
}

// TestServerCheckConfigRefused: a user whose ACL refuses INFO gets one
// warning for the server, however many connections, and working locks.
func TestServerCheckConfigRefused(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	if err := r.Client().Do(context.Background(), "acl", "setuser", "app", "on", ">pw", "~*", "&*", "+@all", "-info").Err(); err != nil {
		t.Fatal(err)
	}
	h := provisionLock(t, fmt.Sprintf(`{"redis":["redis://app:pw@%s"],"wait":"0s","timeout":"2s"}`, r.Addr))
	logs := observeChecks(t, h)
	srv := handlerServer(t, h, okHandler)
	if seen := hammerURL(t, srv.URL, 20); seen[200] != 20 {
		t.Fatalf("statuses %v, want 20 × 200", seen)
	}
	warns := logs.FilterMessageSnippet("cannot read maxmemory-policy").All()
	if len(warns) != 1 || warns[0].Level != zapcore.WarnLevel || warns[0].ContextMap()["server"] != r.Addr {
		t.Fatalf("want one warning naming %s, got %v", r.Addr, logs.All())
	}
	if n := len(logs.All()); n != 1 {
		t.Errorf("%d log lines, want only the warning: %v", n, logs.All())
	}
}

// TestServerCheckVersionTooOld: a server older than the minimum (here the
// minimum is raised above the installed 7.0) is refused with a clear error:
// one error log, and the lock answers by its fail policy (503, or the
// request passes unlocked with fail_open).
func TestServerCheckVersionTooOld(t *testing.T) {
	t.Parallel()
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_open=%v", failOpen), func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"0s","fail_open":%v}`, r.Addr, failOpen))
			logs := observeChecks(t, h)
			pc := testkit.PooledFor(t, h.poolKeys[0])
			pc.Check.SetMinVersion([2]int{99, 0})
			srv := handlerServer(t, h, okHandler)
			for i := 0; i < 5; i++ {
				resp, body := get(t, srv.URL+"/v")
				if resp == nil {
					t.Fatal("no response")
				}
				if failOpen {
					if resp.StatusCode != 200 {
						t.Fatalf("fail_open: status %d %s, want 200", resp.StatusCode, body)
					}
					continue
				}
				if resp.StatusCode != 503 || !strings.Contains(body, "needs Redis 99.0 or newer") || !strings.Contains(body, "version 7.") {
					t.Fatalf("status %d %q: want 503 saying the server's version and the minimum", resp.StatusCode, body)
				}
			}
			errs := logs.FilterMessageSnippet("too old").All()
			if len(errs) != 1 || errs[0].Level != zapcore.ErrorLevel || errs[0].ContextMap()["server"] != r.Addr {
				t.Fatalf("want one error log naming %s, got %v", r.Addr, logs.All())
			}
			if n, _ := r.Client().Exists(context.Background(), shared.StoredKey(h.Prefix, "/v")).Result(); n != 0 {
				t.Error("a lock was written to a server refused as too old")
			}
		})
	}
}

// usedMemory reads used_memory from INFO memory.
func usedMemory(t *testing.T, c *redis.Client) int64 {
	return infoInt(t, c, "memory", "used_memory")
}

// fillRedis writes 2 MiB and sets maxmemory 256 KiB below the memory then
// used, so the server is clearly over its limit (noeviction keeps the data).
func fillRedis(t *testing.T, c *redis.Client) (maxmemory int64) {
	t.Helper()
	v := strings.Repeat("x", 1024)
	for i := 0; i < 2048; i += 128 {
		pipe := c.Pipeline()
		for j := i; j < i+128; j++ {
			pipe.Set(context.Background(), fmt.Sprintf("fill:%d", j), v, 0)
		}
		if _, err := pipe.Exec(context.Background()); err != nil {
			t.Fatalf("filling redis: %v", err)
		}
	}
	maxmemory = usedMemory(t, c) - 256<<10
	if err := c.ConfigSet(context.Background(), "maxmemory", strconv.FormatInt(maxmemory, 10)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(context.Background(), "probe", "x", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "OOM") {
		t.Fatalf("a write over maxmemory answered %v, want OOM", err)
	}
	return maxmemory
}

// holdOverLimit serves h in front of a handler that holds the request to
// /held (answering body) until release is called, and sends that request;
// it returns once the lock is held. held gets the holder's status.
func holdOverLimit(t *testing.T, h *RedisLock, body string) (srv *httptest.Server, release func(), held chan int) {
	t.Helper()
	in, proceed := make(chan struct{}), make(chan struct{})
	srv = handlerServer(t, h, func(w http.ResponseWriter, req *http.Request) error {
		if req.URL.Path == "/held" {
			close(in)
			<-proceed
		}
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, body)
		return nil
	})
	var once sync.Once
	release = func() { once.Do(func() { close(proceed) }) }
	t.Cleanup(release) // before the server's Cleanup, which waits for the holder
	held = make(chan int, 1)
	go func() {
		resp, _ := get(t, srv.URL+"/held")
		if resp == nil {
			held <- 0
			return
		}
		held <- resp.StatusCode
	}()
	select {
	case <-in:
	case code := <-held:
		t.Fatalf("the holder was answered %d without holding the lock", code)
	case <-time.After(30 * time.Second):
		t.Fatal("the holder did not get the lock within 30s")
	}
	return srv, release, held
}

// TestLockScriptsRespectMaxmemory: on a noeviction server over its
// maxmemory, new locks are refused (503 by the fail policy, with the OOM
// error logged) and write nothing; a lease already held keeps
// being extended and is released (those two scripts only keep or free
// memory, so they run over the limit).
func TestLockScriptsRespectMaxmemory(t *testing.T) {
	t.Parallel()
	r := startRedis(t, "--maxmemory-policy", "noeviction")
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"0s","ttl":"1500ms"}`, r.Addr))
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	h.locker.SetLogger(shared.SlogFor(h.logger))
	srv, release, held := holdOverLimit(t, h, "")
	heldSince := time.Now()
	rc := r.Client() // one connection: each new one costs memory too
	maxmemory := fillRedis(t, rc)
	const n = 400
	// No refused lock may write: no key appears (the number of keys, and
	// none of the refused locks' keys). Used memory is logged, not
	// asserted: it moves by 100 KB and more with Redis's own buffers and
	// the pool's connections on a loaded machine, more than a leak of
	// these 300 locks would take.
	var keysBefore, memBefore int64
	for i := 0; i < n; i++ {
		if i == 100 {
			// The first calls loaded the scripts and warmed the connections.
			keysBefore, memBefore = rc.DBSize(context.Background()).Val(), usedMemory(t, rc)
		}
		resp, body := get(t, fmt.Sprintf("%s/k%d", srv.URL, i))
		if resp == nil || resp.StatusCode != 503 || !strings.Contains(body, "OOM") {
			t.Fatalf("request %d over maxmemory: %v %q, want 503 with the OOM error", i, resp, body)
		}
	}
	if keys := rc.DBSize(context.Background()).Val(); keys > keysBefore {
		t.Errorf("%d keys after the refused locks, %d before: a refused lock wrote", keys, keysBefore)
	}
	if ks := rc.Keys(context.Background(), DefaultLockPrefix+"{/k*").Val(); len(ks) > 0 {
		t.Errorf("keys of refused locks: %v", ks)
	}
	t.Logf("used_memory %d before, %d after %d refused locks (maxmemory %d)", memBefore, usedMemory(t, rc), n-100, maxmemory)
	if len(logs.FilterMessageSnippet("answering 503").FilterFieldKey("error").All()) == 0 ||
		!strings.Contains(fmt.Sprint(logs.All()[0].ContextMap()["error"]), "OOM") {
		t.Errorf("no warning carrying the OOM error: %v", logs.All())
	}
	// The holder's lease (ttl 1.5s) is extended over the limit for more
	// than two ttls.
	time.Sleep(time.Until(heldSince.Add(3200 * time.Millisecond)))
	if rc.Exists(context.Background(), shared.StoredKey(h.Prefix, "/held")).Val() != 1 {
		t.Error("the held lease is gone while its request runs")
	}
	release()
	if code := <-held; code != 200 {
		t.Errorf("holder over maxmemory: status %d, want 200 (lease extended)", code)
	}
	if lost := logs.FilterMessageSnippet("lease lost").Len(); lost != 0 {
		t.Errorf("%d lost leases over maxmemory", lost)
	}
	if !waitFor(10*time.Second, func() bool { return rc.Exists(context.Background(), shared.StoredKey(h.Prefix, "/held")).Val() == 0 }) {
		t.Fatal("the held lock was not released over maxmemory")
	}
}

// TestReplayNotStoredOverMaxmemory: a release that would store a replay
// answer on a server over maxmemory releases the lock without storing it
// (the answer can be replay_max large; a plain release runs over the limit).
func TestReplayNotStoredOverMaxmemory(t *testing.T) {
	t.Parallel()
	r := startRedis(t, "--maxmemory-policy", "noeviction")
	h := provisionLock(t, fmt.Sprintf(`{"redis":["%s"],"wait":"0s","replay":"1m"}`, r.Addr))
	_, release, held := holdOverLimit(t, h, strings.Repeat("y", 200<<10))
	rc := r.Client()
	maxmemory := fillRedis(t, rc)
	before := usedMemory(t, rc)
	release()
	if code := <-held; code != 200 {
		t.Fatalf("holder: status %d, want 200", code)
	}
	key := shared.StoredKey(h.Prefix, "/held")
	if !waitFor(10*time.Second, func() bool { return rc.Exists(context.Background(), key).Val() == 0 }) {
		t.Fatal("the lock was not released over maxmemory")
	}
	if n := rc.Exists(context.Background(), lock.ReplayKey(key)).Val(); n != 0 {
		t.Errorf("a 200 KiB replay answer was stored over maxmemory (used_memory %d → %d, maxmemory %d)", before, usedMemory(t, rc), maxmemory)
	}
}

// TestServerCheckClusterAndSentinel: on a Cluster every master is checked
// once and named by its own address; through a Sentinel the master is
// checked, named by its group (go-redis does not tell its address), and the
// Sentinel itself is not (it holds no keys: no warning about it).
func TestServerCheckClusterAndSentinel(t *testing.T) {
	t.Parallel()
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		rs := startCluster(t)
		for _, r := range rs {
			if err := r.Client().ConfigSet(context.Background(), "maxmemory-policy", "volatile-lru").Err(); err != nil {
				t.Fatal(err)
			}
		}
		h := provisionLock(t, fmt.Sprintf(`{"cluster":["%s"],"wait":"0s","timeout":"2s"}`, rs[0].Addr))
		logs := observeChecks(t, h)
		srv := handlerServer(t, h, okHandler)
		if seen := hammerURL(t, srv.URL, 40); seen[200] != 40 {
			t.Fatalf("statuses %v, want 40 × 200", seen)
		}
		named := map[string]int{}
		for _, e := range logs.FilterMessageSnippet("evicts keys").All() {
			named[fmt.Sprint(e.ContextMap()["server"])]++
		}
		for _, r := range rs {
			if named[r.Addr] != 1 {
				t.Errorf("master %s named in %d eviction errors, want 1 (all: %v)", r.Addr, named[r.Addr], named)
			}
		}
	})
	t.Run("sentinel", func(t *testing.T) {
		t.Parallel()
		master := startRedis(t, "--maxmemory-policy", "allkeys-lfu")
		sentinel := startSentinel(t, master)
		h := provisionLock(t, fmt.Sprintf(`{"sentinel_master":"mymaster","sentinels":["%s"],"wait":"0s","timeout":"2s"}`, sentinel))
		logs := observeChecks(t, h)
		srv := handlerServer(t, h, okHandler)
		if seen := hammerURL(t, srv.URL, 10); seen[200] != 10 {
			t.Fatalf("statuses %v, want 10 × 200", seen)
		}
		errs := logs.FilterMessageSnippet("evicts keys").All()
		want := "sentinel mymaster@" + sentinel
		if len(errs) != 1 || errs[0].ContextMap()["server"] != want || errs[0].ContextMap()["maxmemory_policy"] != "allkeys-lfu" {
			t.Errorf("want one eviction error naming %q: %v", want, logs.All())
		}
		if n := logs.FilterMessageSnippet("cannot read").Len(); n != 0 {
			t.Errorf("%d warnings about unreadable settings (the Sentinel was checked as a server?): %v", n, logs.All())
		}
	})
}

package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/redis/go-redis/v9"
)

// holderCounter is an upstream that counts holders per key at once and the
// answers by status; it never sleeps long, so a holder is gone well before
// a failover completes.
type holderCounter struct {
	mu       sync.Mutex
	inflight map[string]int
	maxSeen  int
	tokens   map[string]int64
	backward int
}

func (u *holderCounter) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	key := r.URL.Path
	tok, _ := strconv.ParseInt(r.Header.Get("Lock-Fencing-Token"), 10, 64)
	u.mu.Lock()
	u.inflight[key]++
	u.maxSeen = max(u.maxSeen, u.inflight[key])
	if tok <= u.tokens[key] {
		u.backward++
	}
	u.tokens[key] = max(u.tokens[key], tok)
	u.mu.Unlock()
	time.Sleep(3 * time.Millisecond)
	u.mu.Lock()
	u.inflight[key]--
	u.mu.Unlock()
	return nil
}

// statusLog records answers with their time.
type statusLog struct {
	mu  sync.Mutex
	got []struct {
		at     time.Time
		status int
	}
}

func (s *statusLog) add(status int) {
	s.mu.Lock()
	s.got = append(s.got, struct {
		at     time.Time
		status int
	}{time.Now(), status})
	s.mu.Unlock()
}

// summary counts answers by status, and returns the first moment after
// from from which every answer had status ok (zero if never).
func (s *statusLog) summary(from time.Time, ok int) (map[int]int, time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	counts := map[int]int{}
	var since time.Time
	for _, g := range s.got {
		counts[g.status]++
		if g.at.Before(from) {
			continue
		}
		if g.status != ok {
			since = time.Time{}
		} else if since.IsZero() {
			since = g.at
		}
	}
	return counts, since
}

// failoverTraffic sends lock requests (lockClients loops over lockURLs) and
// rate-limit requests in closed loops, and records their answers, until
// stop is called.
type failoverTraffic struct {
	lock, rl statusLog
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

func startFailoverTraffic(lockClients int, lockURLs []string, rlURL string) *failoverTraffic {
	ctx, cancel := context.WithCancel(context.Background())
	tr := &failoverTraffic{cancel: cancel}
	client := &http.Client{Timeout: 30 * time.Second}
	loop := func(url string, log *statusLog, pause time.Duration) {
		defer tr.wg.Done()
		for ctx.Err() == nil {
			resp, err := client.Get(url)
			if err != nil {
				log.add(0)
				continue
			}
			resp.Body.Close()
			log.add(resp.StatusCode)
			time.Sleep(pause)
		}
	}
	for i := 0; i < lockClients; i++ {
		tr.wg.Add(1)
		go loop(lockURLs[i%len(lockURLs)], &tr.lock, 2*time.Millisecond)
	}
	tr.wg.Add(2)
	go loop(rlURL, &tr.rl, 5*time.Millisecond)
	go loop(rlURL, &tr.rl, 5*time.Millisecond)
	return tr
}

func (tr *failoverTraffic) stop() {
	tr.cancel()
	tr.wg.Wait()
}

// recovered reports whether both handlers have answered only 200 for 1s
// (hundreds of answers) since switched.
func (tr *failoverTraffic) recovered(switched time.Time) bool {
	_, l := tr.lock.summary(switched, 200)
	_, r := tr.rl.summary(switched, 200)
	return !l.IsZero() && !r.IsZero() && time.Since(l) > time.Second && time.Since(r) > time.Second
}

// check logs the figures of a failover that took effect at switched, and
// fails the test unless the lock and the fail_closed rate limiter answered
// only 200 or 503, no key had two holders, both recovered (the rate limiter
// within 10s), and the scripts ran on the new master.
func (tr *failoverTraffic) check(t *testing.T, what string, fault, switched time.Time, up *holderCounter, newMaster *testRedis) {
	t.Helper()
	lockCounts, lockSince := tr.lock.summary(switched, 200)
	rlCounts, rlSince := tr.rl.summary(switched, 200)
	t.Logf("%s: new master %s after the fault; lock answers %v, 200 only from %s after; rate limiter answers %v, by Redis only from %s after; fencing tokens not above the key's last one: %d",
		what, switched.Sub(fault).Round(time.Millisecond), lockCounts, since(lockSince, switched), rlCounts, since(rlSince, switched), up.backward)
	for name, counts := range map[string]map[int]int{"lock": lockCounts, "fail_closed rate limiter": rlCounts} {
		for s, n := range counts {
			if s != 200 && s != http.StatusServiceUnavailable {
				t.Errorf("%s answered %d %d time(s); want only 200 or 503", name, s, n)
			}
		}
	}
	if up.maxSeen > 1 {
		t.Errorf("%d holders of one key at once", up.maxSeen)
	}
	if lockSince.IsZero() || rlSince.IsZero() {
		t.Fatalf("after the failover the handlers did not recover (lock from %v, rate limiter from %v)", lockSince, rlSince)
	}
	if d := rlSince.Sub(switched); d > 10*time.Second {
		t.Errorf("the rate limiter decided by Redis again %s after the failover; want within seconds", d)
	}
	// The scripts ran on the new master (a replica refuses writes).
	if n := newMaster.CommandCalls("evalsha") + newMaster.CommandCalls("eval"); n < 10 {
		t.Errorf("%d script calls on the new master; the handlers did not move to it", n)
	}
}

func since(at, from time.Time) string {
	if at.IsZero() {
		return "never"
	}
	return at.Sub(from).Round(time.Millisecond).String()
}

// TestSentinelFailoverDuringTraffic: a primary, a replica and 3 sentinels
// (quorum 2); the primary is killed during lock and rate-limit traffic.
// The lock answers only 200 or 503 and never lets two holders in; the
// fail_closed rate limiter answers by Redis again within seconds of the
// promotion; both work on the new primary. The figures are logged.
func TestSentinelFailoverDuringTraffic(t *testing.T) {
	failoverTwoAtATime(t)
	primary := startRedis(t)
	replica := startReplica(t, primary)
	sentinels := startSentinels(t, primary, 3, 2, 1, time.Second)
	list := `"` + strings.Join(sentinels, `","`) + `"`
	conn := fmt.Sprintf(`"sentinel_master":"mymaster","sentinels":[%s],"timeout":"500ms"`, list)
	up := &holderCounter{inflight: map[string]int{}, tokens: map[string]int64{}}
	lock := provisionLock(t, fmt.Sprintf(`{%s,"ttl":"3s","wait":"10s"}`, conn))
	ls := handlerServer(t, lock, up.ServeHTTP)
	rl := provisionRateLimitJSON(t, fmt.Sprintf(`{%s,"fail_closed":true,"key":"failover","algorithm":"gcra","rates":[{"requests":1000000,"window":"1h"}]}`, conn))
	rs := handlerServer(t, rl, okHandler)

	tr := startFailoverTraffic(8, []string{ls.URL + "/k0", ls.URL + "/k1", ls.URL + "/k2", ls.URL + "/k3"}, rs.URL+"/")
	time.Sleep(500 * time.Millisecond) // steady traffic before the fault
	killed := time.Now()
	primary.Kill()
	// Wait for the promotion, then for both handlers to answer only 200 for 1s.
	sc := redis.NewSentinelClient(&redis.Options{Addr: sentinels[0]})
	defer sc.Close()
	var promoted time.Time
	if waitFor(40*time.Second, func() bool {
		a, err := sc.GetMasterAddrByName(context.Background(), "mymaster").Result()
		return err == nil && a[1] == strconv.Itoa(replica.Port)
	}) {
		promoted = time.Now()
		waitFor(20*time.Second, func() bool { return tr.recovered(promoted) })
	}
	tr.stop()
	if promoted.IsZero() {
		t.Fatal("the sentinels did not promote the replica within 40s")
	}
	tr.check(t, "sentinel failover", killed, promoted, up, replica)
}

// clusterHotKey provisions a lock and a fail_closed rate limiter on the
// Cluster rs, both on the hash tag {/hot}, and returns their servers, the
// upstream behind the lock, the tag's slot and the master serving it.
func clusterHotKey(t *testing.T, rs []*testRedis) (ls, rls *httptest.Server, up *holderCounter, slot int64, master *testRedis) {
	t.Helper()
	seeds := fmt.Sprintf(`["%s","%s","%s"]`, rs[0].Addr, rs[1].Addr, rs[2].Addr)
	conn := fmt.Sprintf(`"cluster":%s,"timeout":"500ms"`, seeds)
	up = &holderCounter{inflight: map[string]int{}, tokens: map[string]int64{}}
	lock := provisionLock(t, fmt.Sprintf(`{%s,"ttl":"3s","wait":"10s"}`, conn))
	ls = handlerServer(t, lock, up.ServeHTTP)
	rl := provisionRateLimitJSON(t, fmt.Sprintf(`{%s,"fail_closed":true,"key":"/hot","algorithm":"gcra","rates":[{"requests":1000000,"window":"1h"}]}`, conn))
	rls = handlerServer(t, rl, okHandler)
	ctx := context.Background()
	slot, err := rs[0].Client().ClusterKeySlot(ctx, shared.StoredKey(lock.Prefix, "/hot")).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		nodes, _ := r.Client().ClusterNodes(ctx).Result()
		for _, line := range strings.Split(nodes, "\n") {
			f := strings.Fields(line)
			if len(f) < 9 || !strings.Contains(f[2], "myself") || !strings.Contains(f[2], "master") {
				continue
			}
			for _, rng := range f[8:] {
				lo, hi, ok := strings.Cut(rng, "-")
				if !ok {
					hi = lo
				}
				l, _ := strconv.ParseInt(lo, 10, 64)
				h, _ := strconv.ParseInt(hi, 10, 64)
				if slot >= l && slot <= h {
					master = r
				}
			}
		}
	}
	if master == nil {
		t.Fatal("no master serves the key's slot")
	}
	return ls, rls, up, slot, master
}

// TestClusterFailoverDuringTraffic: on a Cluster of 3 masters and 3
// replicas, the replica of the master that serves a hot lock key and a
// rate-limit key takes over (CLUSTER FAILOVER, the manual, coordinated one)
// during traffic. The lock answers only 200 or 503 and never lets two
// holders in, the fail_closed rate limiter decides by Redis again within
// seconds, and both end up on the new master.
func TestClusterFailoverDuringTraffic(t *testing.T) {
	failoverTwoAtATime(t)
	rs := startClusterNodes(t, 3, 1)
	ctx := context.Background()
	ls, rls, up, _, master := clusterHotKey(t, rs)
	var replica *testRedis
	for _, r := range rs {
		info, _ := r.Client().Info(ctx, "replication").Result()
		if strings.Contains(info, "role:slave") && strings.Contains(info, fmt.Sprintf("master_port:%d", master.Port)) {
			replica = r
		}
	}
	if replica == nil {
		t.Fatal("the key's master has no replica")
	}

	tr := startFailoverTraffic(6, []string{ls.URL + "/hot"}, rls.URL+"/")
	time.Sleep(500 * time.Millisecond) // steady traffic before the fault
	started := time.Now()
	// A manual failover that does not complete in time (a loaded machine)
	// is aborted by Redis; ask again then.
	isMaster := func() bool {
		info, _ := replica.Client().Info(ctx, "replication").Result()
		return strings.Contains(info, "role:master")
	}
	var switched time.Time
	for try := 0; try < 5 && switched.IsZero(); try++ {
		if try > 0 && isMaster() {
			switched = time.Now()
			break
		}
		if err := replica.Client().Do(ctx, "CLUSTER", "FAILOVER").Err(); err != nil {
			t.Fatalf("CLUSTER FAILOVER: %v", err)
		}
		if waitFor(6*time.Second, isMaster) {
			switched = time.Now()
		}
	}
	if switched.IsZero() {
		tr.stop()
		t.Fatal("the replica did not become master after 5 manual failovers, 6s each")
	}
	waitFor(20*time.Second, func() bool { return tr.recovered(switched) })
	tr.stop()
	tr.check(t, "cluster failover", started, switched, up, replica)
}

// TestClusterSlotMigrationDuringTraffic: the slot of a hot lock key and a
// rate-limit key (hash tag {/hot}) moves to another master during traffic
// (SETSLOT IMPORTING/MIGRATING, MIGRATE of its keys in steps, SETSLOT
// NODE), the way redis-cli --cluster reshard does it. The lock answers
// only 200 or 503 and never lets two holders in, the fail_closed rate
// limiter answers by Redis again within seconds of the move, and both end
// up on the new master.
func TestClusterSlotMigrationDuringTraffic(t *testing.T) {
	failoverTwoAtATime(t)
	rs := startClusterNodes(t, 3, 0)
	ctx := context.Background()
	ls, rls, up, slot, src := clusterHotKey(t, rs)
	dst := rs[0]
	if dst == src {
		dst = rs[1]
	}
	id := func(r *testRedis) string {
		v, err := r.Client().Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	srcID, dstID := id(src), id(dst)
	do := func(r *testRedis, args ...any) {
		if err := r.Client().Do(ctx, args...).Err(); err != nil {
			t.Fatalf("%v on %s: %v", args, r, err)
		}
	}
	tr := startFailoverTraffic(6, []string{ls.URL + "/hot"}, rls.URL+"/")
	time.Sleep(500 * time.Millisecond) // steady traffic before the fault
	started := time.Now()
	do(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", srcID)
	do(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dstID)
	// Move the keys one at a time, with traffic in between, so requests
	// meet the slot half moved.
	moved := 0
	for i := 0; i < 100; i++ {
		keys, err := src.Client().ClusterGetKeysInSlot(ctx, int(slot), 1).Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) == 0 {
			break
		}
		time.Sleep(300 * time.Millisecond)
		if err := src.Client().Do(ctx, "MIGRATE", "127.0.0.1", dst.Port, keys[0], 0, 5000).Err(); err != nil && !strings.Contains(err.Error(), "NOKEY") {
			t.Fatalf("MIGRATE %s: %v", keys[0], err)
		}
		moved++
	}
	time.Sleep(300 * time.Millisecond)
	for _, r := range rs {
		do(r, "CLUSTER", "SETSLOT", slot, "NODE", dstID)
	}
	switched := time.Now()
	waitFor(20*time.Second, func() bool { return tr.recovered(switched) })
	tr.stop()
	t.Logf("slot %d moved with %d keys in %s", slot, moved, switched.Sub(started).Round(time.Millisecond))
	tr.check(t, "slot migration", started, switched, up, dst)
}

// failoverTwoAtATime runs a failover test in parallel with the lighter
// tests, but at most two of them at once: each starts many redis-server
// processes and steady traffic.
var failoverSlots = make(chan struct{}, 2)

func failoverTwoAtATime(t *testing.T) {
	t.Parallel()
	failoverSlots <- struct{}{}
	t.Cleanup(func() { <-failoverSlots })
}

package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/redis/go-redis/v9"
)

// minimalACL is the Redis ACL the plugin needs with the default prefixes
// (README "Redis ACL" gives the same line): key patterns, the wake-up
// channel and the commands the scripts and the clients send. With
// sync_replicas add +wait; with a db other than 0 add +select.
const minimalACL = "~caddy:lock:* ~caddy:rl:* ~caddy:fence:* resetchannels &redisdlm:wake &redisdlm:rl:forget -@all +evalsha +eval +time +zremrangebyscore +zscore +zcard +zrange +zadd +pexpire +pexpireat +zrem +get +set +exists +del +pttl +publish +getrange +setrange +subscribe +ping +info"

const aclUser, aclPassword = "caddy", "acl-pw-1"

// startACLRedis starts a redis-server whose user aclUser has exactly
// minimalACL; the default user is off, as on a hardened server, and the
// test inspects Redis as "admin" (aclAdmin).
func startACLRedis(t *testing.T) *testRedis {
	t.Helper()
	args := append([]string{"--user", "default", "off", "--user", "admin", "on", ">admin-pw", "~*", "&*", "+@all",
		"--user", aclUser, "on", ">" + aclPassword}, strings.Fields(minimalACL)...)
	return startRedis(t, args...)
}

func aclAdmin(t *testing.T, r *testRedis) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: r.Addr, Username: "admin", Password: "admin-pw"})
	t.Cleanup(func() { c.Close() })
	return c
}

// checkACLLog fails the test when Redis denied anything: a command, a key
// or a channel.
func checkACLLog(t *testing.T, r *testRedis) {
	t.Helper()
	denied, err := aclAdmin(t, r).Do(context.Background(), "ACL", "LOG").Slice()
	if err != nil {
		t.Fatal(err)
	}
	if len(denied) != 0 {
		t.Errorf("%s denied the ACL user %d time(s): %v", r, len(denied), denied)
	}
}

// TestACLMinimal: both handlers work for a Redis user limited to exactly
// minimalACL — locks (over two clients, so wake-ups cross Pub/Sub), permits,
// waits that run out, both rate-limit algorithms — Redis denies nothing
// (ACL LOG stays empty), every granted command but those of the paths of
// TestACLMinimalRedlockAndCount is used, and the README quotes the same ACL.
func TestACLMinimal(t *testing.T) {
	t.Parallel()
	r := startACLRedis(t)
	conn := fmt.Sprintf(`"redis":[%q],"username":%q,"password":%q`, r.Addr, aclUser, aclPassword)

	up := testkit.NewExclusivityUpstream(2 * time.Millisecond)
	a := provisionLock(t, fmt.Sprintf(`{%s,"timeout":"2s","wait":"30s"}`, conn))
	b := provisionLock(t, fmt.Sprintf(`{%s,"timeout":"3s","wait":"30s"}`, conn))
	if lockClient(t, a) == lockClient(t, b) {
		t.Fatal("both handlers share one client; the test needs two, so wake-ups cross Pub/Sub")
	}
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
	getAllOK(t, 60, []string{sa.URL, sb.URL}, "acl", 3)
	up.Check(t)

	// A semaphore of 2 and a wait that runs out.
	hold := testkit.NewHoldUpstream()
	sem := provisionLock(t, fmt.Sprintf(`{%s,"permits":2,"wait":"0s"}`, conn))
	ss := handlerServer(t, sem, hold.ServeHTTP)
	h1, h2 := testkit.StartHolder(t, hold, ss.URL+"/sem"), testkit.StartHolder(t, hold, ss.URL+"/sem")
	if resp, body := get(t, ss.URL+"/sem"); resp == nil || resp.StatusCode != http.StatusLocked {
		t.Errorf("third holder of 2 permits: %v %s, want 423", resp, body)
	}
	hold.Release()
	for _, ch := range []<-chan testkit.FetchResult{h1, h2} {
		if res := testkit.Await(t, ch, 10*time.Second, "holder"); res.Status != 200 {
			t.Errorf("holder answered %d", res.Status)
		}
	}

	for _, algo := range []string{"sliding_window", "gcra"} {
		rl := provisionRateLimitJSON(t, fmt.Sprintf(`{%s,"fail_closed":true,"algorithm":%q,"key":"acl-%s","rates":[{"requests":3,"window":"1m"},{"requests":50,"window":"1h"}]}`, conn, algo, algo))
		srv := handlerServer(t, rl, okHandler)
		var codes []int
		for i := 0; i < 5; i++ {
			resp, _ := get(t, srv.URL+"/")
			if resp == nil {
				t.FailNow()
			}
			codes = append(codes, resp.StatusCode)
		}
		if fmt.Sprint(codes) != "[200 200 200 429 429]" {
			t.Errorf("%s as ACL user answered %v, want [200 200 200 429 429]", algo, codes)
		}
	}

	// A log longer than the script's first read (40 slots) is written in place.
	long := provisionRateLimitJSON(t, fmt.Sprintf(`{%s,"fail_closed":true,"key":"acl-long","rates":[{"requests":40,"window":"1m"}]}`, conn))
	ls := handlerServer(t, long, okHandler)
	for i := 0; i < 41; i++ {
		want := 200
		if i == 40 {
			want = http.StatusTooManyRequests
		}
		if resp, _ := get(t, ls.URL+"/"); resp == nil || resp.StatusCode != want {
			t.Fatalf("request %d of a 40/1m limit as ACL user: %v, want %d", i, resp, want)
		}
	}

	checkACLLog(t, r)
	ctx := context.Background()
	c := aclAdmin(t, r)
	// Every granted command was used (commandstats counts the commands
	// inside scripts too; the test itself sent only ping, acl and info).
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var unused []string
	for _, f := range strings.Fields(minimalACL) {
		if cmd, ok := strings.CutPrefix(f, "+"); ok && !strings.Contains("ping exists del pttl", cmd) && !strings.Contains(info, "cmdstat_"+cmd+":") {
			unused = append(unused, cmd)
		}
	}
	if len(unused) > 0 {
		sort.Strings(unused)
		t.Logf("granted but not used in this run: %v", unused)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), minimalACL) {
		t.Errorf("README.md does not give the tested ACL:\n%s", minimalACL)
	}
}

// TestACLMinimalRedlockAndCount: the paths the single-server test does not
// take also work under minimalACL: a Redlock of 3 servers over two keys
// (fencing write-back on release) whose lease is extended while one member
// restarts empty (the extension re-creates it there), and `count` settling
// answers that do not count, for both algorithms.
func TestACLMinimalRedlockAndCount(t *testing.T) {
	t.Parallel()
	rs := []*testRedis{startACLRedis(t), startACLRedis(t), startACLRedis(t)}
	auth := fmt.Sprintf(`"username":%q,"password":%q`, aclUser, aclPassword)
	lock := provisionLock(t, fmt.Sprintf(`{"redis":[%q,%q,%q],%s,"ttl":"3s","timeout":"2s","keys":["{http.request.header.A}","{http.request.header.B}"]}`,
		rs[0].Addr, rs[1].Addr, rs[2].Addr, auth))
	// The holder runs until an extension has re-created its lease on the
	// member that restarted empty (bounded).
	admin2 := aclAdmin(t, rs[2])
	recreated := func() bool {
		for _, k := range []string{"x", "y"} {
			if n, _ := admin2.ZCard(context.Background(), shared.StoredKey(lock.Prefix, k)).Result(); n != 1 {
				return false
			}
		}
		return true
	}
	entered, restarted := make(chan struct{}, 1), make(chan struct{})
	var extendedThere atomic.Bool
	slow := handlerServer(t, lock, func(w http.ResponseWriter, r *http.Request) error {
		entered <- struct{}{}
		select {
		case <-restarted:
			extendedThere.Store(waitFor(20*time.Second, recreated))
		case <-time.After(20 * time.Second):
		}
		return nil
	})
	done := goFetchHdr(slow.URL+"/", "A", "x", "B", "y")
	select {
	case <-entered:
	case res := <-done:
		t.Fatalf("Redlock request answered %d %v before it held the lock", res.Status, res.Err)
	case <-time.After(20 * time.Second):
		t.Fatal("the Redlock request did not get the lock within 20s")
	}
	rs[2].Restart()
	close(restarted)
	res := testkit.Await(t, done, 30*time.Second, "Redlock request")
	if res.Status != 200 {
		t.Errorf("Redlock over two keys as ACL user: %d %v", res.Status, res.Err)
	}
	if !extendedThere.Load() {
		t.Error("no extension re-created the lease on the member that restarted empty within 20s")
	}
	for _, algo := range []string{"sliding_window", "gcra"} {
		rl := provisionRateLimitJSON(t, fmt.Sprintf(`{"redis":[%q],%s,"fail_closed":true,"algorithm":%q,"key":"count-%s","count":["401"],"rates":[{"requests":2,"window":"1m"}]}`,
			rs[0].Addr, auth, algo, algo))
		srv := handlerServer(t, rl, okHandler)
		for i := 0; i < 4; i++ { // 200s do not count: never rejected
			if resp, body := get(t, srv.URL+"/"); resp == nil || resp.StatusCode != 200 {
				t.Fatalf("%s with count as ACL user, request %d: %v %s", algo, i, resp, body)
			}
		}
	}
	for _, r := range rs {
		checkACLLog(t, r)
	}
	var stats string
	for _, r := range rs {
		info, _ := aclAdmin(t, r).Info(context.Background(), "commandstats").Result()
		stats += info
	}
	for _, cmd := range []string{"exists", "del", "pttl"} {
		if !strings.Contains(stats, "cmdstat_"+cmd+":") {
			t.Logf("granted for this path but not used in this run: %s", cmd)
		}
	}
}

// goFetchHdr is testkit.GoFetch with request headers (name, value pairs).
func goFetchHdr(url string, hdr ...string) <-chan testkit.FetchResult {
	ch := make(chan testkit.FetchResult, 1)
	go func() {
		req, _ := http.NewRequest("GET", url, nil)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		start := time.Now()
		resp, err := testkit.FetchClient.Do(req)
		if err != nil {
			ch <- testkit.FetchResult{Err: err, Took: time.Since(start)}
			return
		}
		resp.Body.Close()
		ch <- testkit.FetchResult{Status: resp.StatusCode, Hdr: resp.Header, Took: time.Since(start)}
	}()
	return ch
}

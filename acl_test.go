package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// minimalACL is the Redis ACL the plugin needs with the default prefixes
// (README "Redis ACL" gives the same line): key patterns, the wake-up
// channel and the commands the scripts and the clients send. With
// sync_replicas add +wait; with a db other than 0 add +select.
const minimalACL = "~caddy:lock:* ~caddy:rl:* resetchannels &redisdlm:wake -@all +evalsha +eval +time +zremrangebyscore +zscore +zcard +zrange +zadd +pexpire +pexpireat +zrem +get +set +publish +getrange +setrange +subscribe +ping +info"

// TestACLMinimal: both handlers work for a Redis user limited to exactly
// minimalACL — locks (over two clients, so wake-ups cross Pub/Sub), permits,
// waits that run out, both rate-limit algorithms — Redis denies nothing
// (ACL LOG stays empty), every granted command is used, and the README
// quotes the same ACL.
func TestACLMinimal(t *testing.T) {
	t.Parallel()
	const user, pw = "caddy", "acl-pw-1"
	// The default user is off, as on a hardened server; the test inspects
	// Redis as "admin".
	args := append([]string{"--user", "default", "off", "--user", "admin", "on", ">admin-pw", "~*", "&*", "+@all",
		"--user", user, "on", ">" + pw}, strings.Fields(minimalACL)...)
	r := startRedis(t, args...)
	conn := fmt.Sprintf(`"redis":[%q],"username":%q,"password":%q`, r.Addr, user, pw)

	up := newExclusivityUpstream(2 * time.Millisecond)
	a := provisionLock(t, fmt.Sprintf(`{%s,"timeout":"2s","wait":"30s"}`, conn))
	b := provisionLock(t, fmt.Sprintf(`{%s,"timeout":"3s","wait":"30s"}`, conn))
	if a.locker.servers[0] == b.locker.servers[0] {
		t.Fatal("both handlers share one client; the test needs two, so wake-ups cross Pub/Sub")
	}
	sa, sb := handlerServer(t, a, up.ServeHTTP), handlerServer(t, b, up.ServeHTTP)
	getAllOK(t, 60, []string{sa.URL, sb.URL}, "acl", 3)
	up.check(t)

	// A semaphore of 2 and a wait that runs out.
	hold := newHoldUpstream()
	sem := provisionLock(t, fmt.Sprintf(`{%s,"permits":2,"wait":"0s"}`, conn))
	ss := handlerServer(t, sem, hold.ServeHTTP)
	h1, h2 := startHolder(t, hold, ss.URL+"/sem"), startHolder(t, hold, ss.URL+"/sem")
	if resp, body := get(t, ss.URL+"/sem"); resp == nil || resp.StatusCode != http.StatusLocked {
		t.Errorf("third holder of 2 permits: %v %s, want 423", resp, body)
	}
	hold.Release()
	for _, ch := range []<-chan fetchResult{h1, h2} {
		if res := await(t, ch, 10*time.Second, "holder"); res.status != 200 {
			t.Errorf("holder answered %d", res.status)
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

	// Redis refused nothing: no denied command, key or channel.
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: r.Addr, Username: "admin", Password: "admin-pw"})
	defer c.Close()
	denied, err := c.Do(ctx, "ACL", "LOG").Slice()
	if err != nil {
		t.Fatal(err)
	}
	if len(denied) != 0 {
		t.Errorf("Redis denied the ACL user %d time(s): %v", len(denied), denied)
	}
	// Every granted command was used (commandstats counts the commands
	// inside scripts too; the test itself sent only ping, acl and info).
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var unused []string
	for _, f := range strings.Fields(minimalACL) {
		if cmd, ok := strings.CutPrefix(f, "+"); ok && cmd != "ping" && !strings.Contains(info, "cmdstat_"+cmd+":") {
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

package redisdlm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// adminCall sends one request to Caddy's admin endpoint and decodes the
// JSON answer into a map (nil when the body is not a JSON object).
func adminCall(t *testing.T, method, u string) (int, map[string]any, string) {
	t.Helper()
	req, _ := http.NewRequest(method, u, nil)
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		m = nil
	}
	if ct := resp.Header.Get("Content-Type"); m == nil || !strings.Contains(ct, "json") {
		t.Errorf("%s %s: answer %q (Content-Type %q) is not a JSON object", method, u, b, ct)
	}
	return resp.StatusCode, m, string(b)
}

// TestAdminListHandlers: GET /redisdlm/ lists the running config's handlers
// (name, kind, servers without user info, prefix, keys, position), only
// those of the running config after a reload, and nothing secret.
func TestAdminListHandlers(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	_, redlock := startRedlock(t, 3)
	var addrs []string
	_ = json.Unmarshal([]byte(redlock), &addrs)
	port, port2, admin := freePort(t), freePort(t), freePort(t)
	conf := func(extra string) string {
		return fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	redis_ratelimit /api/* {
		name api
		key {http.request.header.X-User}
		rate 3 10s
		redis redis://admin:s3cret-pw@%s/2?client_name=x
	}
	redis_lock /orders* {
		name orders
		key {http.request.header.X-User}
		redis %s
	}
	redis_lock /jobs/* {
		prefix jobs:
		password hunter2-secret
		redis %s
	}
	%s
	respond ok
}
:%d {
	redis_lock {
		name other_site
		redis %s
	}
	respond ok
}
`, admin, port, addrs[0], strings.Join(addrs, " "), addrs[0], extra, port2, addrs[0])
	}
	testkit.RunCaddy(t, conf(""))
	base := fmt.Sprintf("http://localhost:%d/redisdlm/", admin)
	status, m, body := adminCall(t, "GET", base)
	if status != 200 {
		t.Fatalf("GET /redisdlm/: %d %s", status, body)
	}
	for _, secret := range []string{"s3cret-pw", "hunter2-secret", "admin:", "client_name"} {
		if strings.Contains(body, secret) {
			t.Errorf("the list shows %q: %s", secret, body)
		}
	}
	list, _ := m["handlers"].([]any)
	if len(list) != 4 {
		t.Fatalf("%d handlers listed, want 4: %s", len(list), body)
	}
	// Sorted by HTTP server, then in route order; found here by name (the
	// adapter names the servers), the unnamed one by its prefix.
	byName := map[string]map[string]any{}
	for i, h := range list {
		h := h.(map[string]any)
		if h["position"] != float64(i) {
			t.Errorf("entry %d has position %v", i, h["position"])
		}
		if i > 0 && h["http_server"].(string) < list[i-1].(map[string]any)["http_server"].(string) {
			t.Errorf("the list is not ordered by HTTP server: %s", body)
		}
		name, _ := h["name"].(string)
		if name == "" && h["prefix"] == "jobs:" {
			name = "(jobs)"
		}
		byName[name] = h
	}
	jobsPath := ""
	if j := byName["(jobs)"]; j != nil {
		jobsPath = fmt.Sprintf("/redisdlm/locks/%v/", j["position"])
	}
	want := []struct {
		name, kind, prefix string
		servers, keys      []string
		path               string
	}{
		{"api", "redis_ratelimit", "caddy:rl:", []string{"redis://" + addrs[0] + "/2"}, []string{"{http.request.header.X-User}"}, "/redisdlm/limits/api/"},
		{"orders", "redis_lock", "caddy:lock:", addrs, []string{"{http.request.header.X-User}"}, "/redisdlm/locks/orders/"},
		{"(jobs)", "redis_lock", "jobs:", []string{addrs[0]}, []string{"{http.request.uri.path}"}, jobsPath},
		{"other_site", "redis_lock", "caddy:lock:", []string{addrs[0]}, []string{"{http.request.uri.path}"}, "/redisdlm/locks/other_site/"},
	}
	for _, w := range want {
		h := byName[w.name]
		if h == nil {
			t.Errorf("handler %s not listed: %s", w.name, body)
			continue
		}
		if h["kind"] != w.kind || h["prefix"] != w.prefix || h["path"] != w.path {
			t.Errorf("handler %s: %v, want kind %s prefix %s path %s", w.name, h, w.kind, w.prefix, w.path)
		}
		if got := fmt.Sprint(h["servers"]); got != fmt.Sprint(w.servers) {
			t.Errorf("handler %s: servers %s, want %v", w.name, got, w.servers)
		}
		if got := fmt.Sprint(h["keys"]); got != fmt.Sprint(w.keys) {
			t.Errorf("handler %s: keys %s, want %v", w.name, got, w.keys)
		}
	}
	if j := byName["(jobs)"]; j == nil || j["name"] != nil {
		t.Errorf("the unnamed handler: %v", j)
	}
	// Positions stay across reloads of the same config (Caddy provisions
	// its servers in no set order).
	for i := 0; i < 4; i++ {
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(conf("")), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatal(err)
		}
		if _, _, again := adminCall(t, "GET", base); again != body {
			t.Fatalf("after reload %d the list changed:\n%s\nbefore:\n%s", i, again, body)
		}
	}

	// After a reload only the new config's handlers are listed.
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(conf(`redis_lock /more* {
		name more
		redis `+addrs[1]+`
	}`)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	_, m, body = adminCall(t, "GET", base)
	list, _ = m["handlers"].([]any)
	if len(list) != 5 || !strings.Contains(body, `"more"`) {
		t.Errorf("after a reload: %d handlers, want 5 with \"more\": %s", len(list), body)
	}

	// Unknown resources and handlers: 404 with a JSON error.
	for _, p := range []string{"locks/nope/k", "limits/nope/k", "locks/api/k", "limits/orders/k", "locks/" + fmt.Sprint(byName["api"]["position"]) + "/k", "locks/9/k", "nothing/here"} {
		status, m, body := adminCall(t, "GET", base+p)
		if status != 404 || m == nil || m["error"] == nil {
			t.Errorf("GET %s: %d %s, want 404 with a JSON error", p, status, body)
		}
	}
	if status, _, body := adminCall(t, "DELETE", base+"locks/orders/k"); status != 405 {
		t.Errorf("DELETE on a lock: %d %s, want 405", status, body)
	}
}

// lockUpstream is a test upstream: requests with ?hold=1 block until their
// context ends (or 20s); it records what it saw.
type lockUpstream struct {
	mu       sync.Mutex
	seen     []string // ?n= of each request, in arrival order
	canceled []string
}

func (u *lockUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := r.URL.Query().Get("n")
	u.mu.Lock()
	u.seen = append(u.seen, n)
	u.mu.Unlock()
	if r.URL.Query().Get("hold") == "1" {
		select {
		case <-r.Context().Done():
			u.mu.Lock()
			u.canceled = append(u.canceled, n)
			u.mu.Unlock()
			return
		case <-time.After(20 * time.Second):
		}
	}
	fmt.Fprintf(w, "served %s fence=%s", n, r.Header.Get("Lock-Fencing-Token"))
}

func (u *lockUpstream) saw(n string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Contains(u.seen, n)
}

func (u *lockUpstream) wasCanceled(n string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Contains(u.canceled, n)
}

// TestAdminLockInspectAndRelease: through Caddy's admin endpoint, a held
// lock with a waiter shows its holder, lease, fencing counter and waiters
// (per server with Redlock); a force release frees it for the waiter, the
// old holder's next extension finds its lease lost (on_lost cancel: its
// upstream request is canceled, it gets 503) — also with Redlock, where an
// extension would otherwise re-create the missing lease — and the release
// is counted as a lost lease.
func TestAdminLockInspectAndRelease(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	for _, servers := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d servers", servers), func(t *testing.T) {
			_, list := startRedlock(t, servers)
			var addrs []string
			_ = json.Unmarshal([]byte(list), &addrs)
			up := &lockUpstream{}
			us := httptest.NewServer(up)
			defer us.Close()
			port, admin := freePort(t), freePort(t)
			testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	redis_lock /jobs/* {
		name jobs
		ttl 1500ms
		wait 15s
		timeout 1s
		redis %s
	}
	reverse_proxy %s
}
`, admin, port, strings.Join(addrs, " "), strings.TrimPrefix(us.URL, "http://")))
			base := fmt.Sprintf("http://127.0.0.1:%d", port)
			lockURL := fmt.Sprintf("http://localhost:%d/redisdlm/locks/jobs/%s", admin, url.PathEscape("/jobs/reindex"))

			if status, m, body := adminCall(t, "GET", lockURL); status != 404 || m["error"] == nil {
				t.Errorf("a key never used: %d %s, want 404 with a JSON error", status, body)
			}
			if status, _, body := adminCall(t, "POST", lockURL+"/release"); status != 404 {
				t.Errorf("releasing a key not held: %d %s, want 404", status, body)
			}

			lostBefore := lostCount("jobs")
			type answer struct {
				status int
				body   string
			}
			answers := make(chan answer, 2)
			send := func(n, hold string) {
				resp, body := get(t, base+"/jobs/reindex?n="+n+"&hold="+hold)
				if resp == nil {
					answers <- answer{}
					return
				}
				answers <- answer{resp.StatusCode, body}
			}
			go send("A", "1")
			if !waitFor(5*time.Second, func() bool { return up.saw("A") }) {
				t.Fatal("the first request never reached the upstream")
			}
			go send("B", "0")
			var m map[string]any
			var body string
			ok := waitFor(5*time.Second, func() bool {
				_, m, body = adminCall(t, "GET", lockURL)
				return m["waiters_here"] == 1.0
			})
			if !ok {
				t.Fatalf("the waiter never showed in the admin API: %s", body)
			}
			if m["held"] != true || m["held_here"] != 1.0 || m["key"] != "/jobs/reindex" || m["redis_key"] != "caddy:lock:{/jobs/reindex}" {
				t.Errorf("lock view %s: want held, held_here 1, key and redis_key", body)
			}
			svs, _ := m["servers"].([]any)
			if len(svs) != servers {
				t.Fatalf("%d servers in the view, want %d: %s", len(svs), servers, body)
			}
			for i, s := range svs {
				sv := s.(map[string]any)
				holders, _ := sv["holders"].([]any)
				if sv["server"] != addrs[i] || sv["holder_count"] != 1.0 || len(holders) != 1 || sv["replay"] != nil {
					t.Errorf("server %d: %v, want %s with one holder and no replay", i, sv, addrs[i])
					continue
				}
				left := holders[0].(map[string]any)["lease_left_ms"].(float64)
				if left <= 0 || left > 1500 {
					t.Errorf("server %d: lease left %vms, want in (0, 1500]", i, left)
				}
				if f, _ := sv["fencing_counter"].(float64); f < 1 {
					t.Errorf("server %d: fencing counter %v, want >= 1", i, sv["fencing_counter"])
				}
			}
			if up.saw("B") {
				t.Fatal("the waiter was served while the lock was held")
			}

			status, m, body := adminCall(t, "POST", lockURL+"/release")
			if status != 200 || !strings.Contains(body, `"holders_removed": 1`) {
				t.Fatalf("release: %d %s", status, body)
			}
			got := map[int]string{}
			for i := 0; i < 2; i++ {
				select {
				case a := <-answers:
					got[a.status] = a.body
				case <-time.After(15 * time.Second):
					t.Fatalf("after the release, answers %v; want the waiter's 200 and the old holder's 503", got)
				}
			}
			if _, canceled := got[503]; !strings.Contains(got[200], "served B") || !canceled {
				t.Errorf("answers %v: want the waiter served (200) and the old holder canceled (503)", got)
			}
			// The upstream sees the cancel when the proxy drops its
			// connection, which may be after the client had its answer.
			if !waitFor(5*time.Second, func() bool { return up.wasCanceled("A") }) {
				t.Error("the old holder's upstream request was not canceled (on_lost cancel)")
			}
			if lostCount("jobs") < lostBefore+1 {
				t.Error("the force release was not counted as a lost lease")
			}
		})
	}
}

// TestAdminQuota: GET shows each rate's used, remaining and reset without
// counting a request; DELETE resets the key's quota, also in the deny cache;
// both algorithms; unknown keys are 404.
func TestAdminQuota(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	port, admin := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	redis_ratelimit /sw {
		name sw
		key {http.request.header.X-User}
		rate 3 10s
		rate 10 1m
		redis %s
		timeout 5s
	}
	redis_ratelimit /gcra {
		key {http.request.header.X-User}
		rate 3 10s
		rate 10 1m
		algorithm gcra
		redis %s
		timeout 5s
	}
	redis_ratelimit /plan {
		name plan
		rate {http.request.header.X-N} 1m
		redis %s
	}
	respond ok
}
`, admin, port, r.Addr, r.Addr, r.Addr))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	// The unnamed handler is addressed by its position (the adapter sorts
	// the routes by path, so look it up).
	_, m, body := adminCall(t, "GET", fmt.Sprintf("http://localhost:%d/redisdlm/", admin))
	gcraRef := ""
	for _, h := range m["handlers"].([]any) {
		if h := h.(map[string]any); h["algorithm"] == "gcra" && h["name"] == nil {
			gcraRef = fmt.Sprint(h["position"])
		}
	}
	if gcraRef == "" {
		t.Fatalf("no unnamed gcra handler listed: %s", body)
	}
	if !strings.Contains(body, `"template": "{http.request.header.X-N} 1m0s"`) {
		t.Errorf("the plan's rate is not listed as its template: %s", body)
	}
	for _, c := range []struct{ path, ref string }{{"/sw", "sw"}, {"/gcra", gcraRef}} {
		t.Run(c.path, func(t *testing.T) {
			quota := fmt.Sprintf("http://localhost:%d/redisdlm/limits/%s/%s", admin, c.ref, url.PathEscape("user:alice/1"))
			if status, m, body := adminCall(t, "GET", quota); status != 404 || m["error"] == nil {
				t.Errorf("no request yet: %d %s, want 404", status, body)
			}
			call := func() int {
				resp, _ := get(t, base+c.path, "X-User", "user:alice/1")
				if resp == nil {
					return 0
				}
				return resp.StatusCode
			}
			for i := 0; i < 2; i++ {
				if s := call(); s != 200 {
					t.Fatalf("request %d: %d", i, s)
				}
			}
			for i := 0; i < 3; i++ { // reading does not count
				status, m, body := adminCall(t, "GET", quota)
				if status != 200 {
					t.Fatalf("GET quota: %d %s", status, body)
				}
				rates, _ := m["rates"].([]any)
				if len(rates) != 2 {
					t.Fatalf("rates %s", body)
				}
				r0, r1 := rates[0].(map[string]any), rates[1].(map[string]any)
				if r0["policy"] != "r0" || r0["used"] != 2.0 || r0["remaining"] != 1.0 || r1["used"] != 2.0 || r1["remaining"] != 8.0 {
					t.Errorf("read %d: %s; want r0 used 2 remaining 1, r1 used 2 remaining 8", i, body)
				}
				if reset, _ := r0["reset"].(float64); reset < 1 || reset > 10 {
					t.Errorf("r0 reset %v, want 1..10 seconds", r0["reset"])
				}
			}
			if s := call(); s != 200 {
				t.Fatalf("third request: %d", s)
			}
			if s := call(); s != 429 {
				t.Fatalf("fourth request: %d, want 429", s)
			}
			status, _, body := adminCall(t, "DELETE", quota)
			if status != 200 || !strings.Contains(body, `"reset": true`) {
				t.Fatalf("DELETE: %d %s", status, body)
			}
			if s := call(); s != 200 {
				t.Errorf("after the reset: %d, want 200", s)
			}
			if status, _, _ := adminCall(t, "DELETE", quota+"x"); status != 404 {
				t.Errorf("reset of an unknown key: %d, want 404", status)
			}
		})
	}
}

// TestHandlerNames: `name` is parsed and checked in the Caddyfile, checked
// again for JSON configs, and unique per kind in one config.
func TestHandlerNames(t *testing.T) {
	t.Parallel()
	for _, dir := range []string{"redis_lock", "redis_ratelimit"} {
		for in, want := range map[string]string{
			"name":             "name: want exactly one argument",
			"name a b":         "name: want exactly one argument",
			"name 12":          "must not be all digits",
			"name a/b":         "letters, digits",
			"name orders.v2_x": "",
		} {
			d := caddyfile.NewTestDispenser(dir + " {\n\t" + in + "\n\trate 1 1s\n}")
			var err error
			var got string
			if dir == "redis_lock" {
				h := new(redislock.RedisLock)
				d = caddyfile.NewTestDispenser(dir + " {\n\t" + in + "\n}")
				err, got = h.UnmarshalCaddyfile(d), h.Name
			} else {
				h := new(redisratelimit.RedisRateLimit)
				err, got = h.UnmarshalCaddyfile(d), h.Name
			}
			switch {
			case want == "" && (err != nil || got != "orders.v2_x"):
				t.Errorf("%s %q: %v, name %q", dir, in, err, got)
			case want != "" && (err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), dir+": name") || !strings.Contains(err.Error(), ":2")):
				t.Errorf("%s %q: error %v, want %q naming %s: name and the line", dir, in, err, want, dir)
			}
		}
	}

	r := startRedis(t)
	validate := func(caddyfileText string) error {
		cfgJSON, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
		if err != nil {
			return err
		}
		var cfg caddy.Config
		if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
			return err
		}
		// Validate provisions a whole config: not beside a running one.
		testkit.WholeCaddy.Lock()
		defer testkit.WholeCaddy.Unlock()
		return caddy.Validate(&cfg)
	}
	site := func(body string) string { return ":0 {\n" + body + "\nrespond ok\n}\n" }
	lock := func(path, name string) string {
		return fmt.Sprintf("redis_lock %s {\n name %s\n redis %s\n}\n", path, name, r.Addr)
	}
	limit := func(path, name string) string {
		return fmt.Sprintf("redis_ratelimit %s {\n name %s\n rate 1 1s\n redis %s\n}\n", path, name, r.Addr)
	}
	if err := validate(site(lock("/a", "dup") + lock("/b", "dup"))); err == nil || !strings.Contains(err.Error(), `redis_lock: name: "dup" is already`) {
		t.Errorf("two locks named dup: %v", err)
	}
	if err := validate(site(limit("/a", "dup") + limit("/b", "dup"))); err == nil || !strings.Contains(err.Error(), `redis_ratelimit: name: "dup" is already`) {
		t.Errorf("two limits named dup: %v", err)
	}
	if err := validate(site(lock("/a", "same") + limit("/a", "same"))); err != nil {
		t.Errorf("a lock and a limit of one name: %v", err)
	}
	// One site on two ports is two HTTP servers, each with a copy of the
	// handler: its one name is fine (the copies are the same handler).
	twoPorts := "127.0.0.1:18201, 127.0.0.1:18202 {\n" + lock("/a", "jobs") + limit("/b", "api") + "respond ok\n}\n"
	if err := validate(twoPorts); err != nil {
		t.Errorf("a named lock and limit in a site on two ports: %v", err)
	}
	// Different handlers of one name in two servers are still an error.
	twoSites := "127.0.0.1:18203 {\n" + lock("/a", "jobs") + "respond ok\n}\n127.0.0.1:18204 {\n" + lock("/other", "jobs") + "redis_lock /x {\n ttl 7s\n name jobs2\n redis " + r.Addr + "\n}\nrespond ok\n}\n"
	if err := validate(strings.Replace(twoSites, "redis_lock /other {\n name jobs\n", "redis_lock /other {\n name jobs\n ttl 9s\n", 1)); err == nil || !strings.Contains(err.Error(), `"jobs" is already`) {
		t.Errorf("two different locks named jobs in two servers: %v", err)
	}
	// JSON bypasses the Caddyfile parser: Provision checks the name.
	h := new(redislock.RedisLock)
	_ = json.Unmarshal([]byte(fmt.Sprintf(`{"name":"007","redis":["%s"]}`, r.Addr)), h)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	if err := h.Provision(ctx); err == nil || !strings.Contains(err.Error(), "redis_lock: name:") {
		t.Errorf("JSON name 007: %v", err)
	}
	_ = h.Cleanup()
}

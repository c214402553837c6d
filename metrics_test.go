package redisdlm

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// scrapedSeries is one series of the admin /metrics endpoint.
type scrapedSeries struct {
	name   string
	labels map[string]string
	value  float64
}

var (
	seriesLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)`)
	labelPair  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)
)

// scrapeMetrics reads the admin /metrics endpoint at port: the
// caddy_redis_* series.
func scrapeMetrics(t *testing.T, port int) []scrapedSeries {
	t.Helper()
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Get(fmt.Sprintf("http://localhost:%d/metrics", port))
	if err != nil {
		t.Fatalf("scraping /metrics: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("scraping /metrics: %d %s", resp.StatusCode, b)
	}
	var out []scrapedSeries
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "caddy_redis_") {
			continue
		}
		m := seriesLine.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("unparsable series line %q", line)
		}
		s := scrapedSeries{name: m[1], labels: map[string]string{}}
		for _, p := range labelPair.FindAllStringSubmatch(m[2], -1) {
			s.labels[p[1]] = p[2]
		}
		s.value, _ = strconv.ParseFloat(m[3], 64)
		out = append(out, s)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// handlersOf maps each metric family (histogram series folded into their
// metric) to the handler label values its series carry; a series without
// the label fails the test.
func handlersOf(t *testing.T, series []scrapedSeries) map[string]map[string]bool {
	t.Helper()
	out := map[string]map[string]bool{}
	for _, s := range series {
		fam := s.name
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if strings.HasSuffix(fam, suf) && strings.Contains(fam, "_seconds") {
				fam = strings.TrimSuffix(fam, suf)
			}
		}
		h, ok := s.labels["handler"]
		if !ok || h == "" {
			t.Errorf("series %s%v carries no handler label", s.name, s.labels)
			continue
		}
		if out[fam] == nil {
			out[fam] = map[string]bool{}
		}
		out[fam][h] = true
	}
	return out
}

// seriesValue is the value of the series name with the given labels (and
// any others); found false when none matches.
func seriesValue(series []scrapedSeries, name string, labels ...string) (v float64, found bool) {
	for _, s := range series {
		if s.name != name {
			continue
		}
		match := true
		for i := 0; i+1 < len(labels); i += 2 {
			if s.labels[labels[i]] != labels[i+1] {
				match = false
			}
		}
		if match {
			v += s.value
			found = true
		}
	}
	return v, found
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

var (
	hashedLockLabel = regexp.MustCompile(`^lock-[0-9a-f]{8}$`)
	hashedRLLabel   = regexp.MustCompile(`^rl-[0-9a-f]{8}$`)
)

// labelsConfig is the Caddyfile of TestWholeCaddyMetricsHandlerLabels: two
// lock handlers and two limiters on one Redis, one of each named; rlRate
// is the unnamed limiter's rate. No `metrics` global option: the plugin's
// series are at the admin endpoint without it.
func labelsConfig(admin, port int, addr, rlRate string) string {
	return fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	route /a/* {
		redis_lock {
			name orders
			redis %s
		}
		respond "a"
	}
	route /b/* {
		redis_lock {
			redis %s
			ttl 20s
		}
		respond "b"
	}
	route /c/* {
		redis_ratelimit {
			name logins
			redis %s
			rate 1000 1m
		}
		respond "c"
	}
	route /d/* {
		redis_ratelimit {
			redis %s
			rate %s
		}
		respond "d"
	}
}
`, admin, port, addr, addr, addr, addr, rlRate)
}

// TestWholeCaddyMetricsHandlerLabels: through a whole Caddy
// without the `metrics` global option, every caddy_redis_* series at the
// admin /metrics endpoint carries a handler label: the name of a named
// handler, else kind and a hash of its config, distinct for two handlers
// of one kind. A reload keeps the series (and counts) of the handlers whose
// config did not change, and drops those of the handler it changed.
func TestWholeCaddyMetricsHandlerLabels(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	admin, port := freePort(t), freePort(t)
	testkit.RunCaddy(t, labelsConfig(admin, port, r.Addr, "1000 1m"))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	for _, p := range []string{"/a/1", "/a/2", "/b/1", "/c/1", "/c/2", "/c/3", "/d/1"} {
		if resp, body := get(t, base+p); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("GET %s: %v %q", p, resp, body)
		}
	}

	series := scrapeMetrics(t, admin)
	byMetric := handlersOf(t, series)
	lockLabels, rlLabels := map[string]bool{}, map[string]bool{}
	for h := range byMetric["caddy_redis_lock_acquire_duration_seconds"] {
		lockLabels[h] = true
	}
	for h := range byMetric["caddy_redis_ratelimit_requests_total"] {
		rlLabels[h] = true
	}
	unnamed := func(labels map[string]bool, re *regexp.Regexp) string {
		for h := range labels {
			if re.MatchString(h) {
				return h
			}
		}
		return ""
	}
	lockHash, rlHash := unnamed(lockLabels, hashedLockLabel), unnamed(rlLabels, hashedRLLabel)
	if len(lockLabels) != 2 || !lockLabels["orders"] || lockHash == "" {
		t.Fatalf("lock acquire series carry handlers %v, want orders and one lock-<hash>", sortedKeys(lockLabels))
	}
	if len(rlLabels) != 2 || !rlLabels["logins"] || rlHash == "" {
		t.Fatalf("rate-limit series carry handlers %v, want logins and one rl-<hash>", sortedKeys(rlLabels))
	}
	want := map[string][]string{
		"caddy_redis_lock_acquire_duration_seconds": {"orders", lockHash},
		"caddy_redis_lock_held_duration_seconds":    {"orders", lockHash},
		"caddy_redis_lock_waiters":                  {"orders", lockHash},
		"caddy_redis_lock_lost_total":               {"orders", lockHash},
		"caddy_redis_lock_release_failures_total":   {"orders", lockHash},
		"caddy_redis_lock_replays_total":            {"orders", lockHash},
		"caddy_redis_ratelimit_requests_total":      {"logins", rlHash},
		"caddy_redis_ratelimit_waited_seconds":      {"logins", rlHash},
		"caddy_redis_evicting_servers":              {"orders", lockHash, "logins", rlHash},
	}
	for metric, hs := range want {
		got := byMetric[metric]
		if len(got) != len(hs) {
			t.Errorf("%s carries handlers %v, want %v", metric, sortedKeys(got), hs)
		}
		for _, h := range hs {
			if !got[h] {
				t.Errorf("%s has no series for handler %s (has %v)", metric, h, sortedKeys(got))
			}
		}
	}
	count := func(series []scrapedSeries, metric, handler, result string) float64 {
		v, _ := seriesValue(series, metric, "handler", handler, "result", result)
		return v
	}
	if n := count(series, "caddy_redis_lock_acquire_duration_seconds_count", "orders", "acquired"); n != 2 {
		t.Errorf("orders: %v acquisitions counted, want 2", n)
	}
	if n := count(series, "caddy_redis_lock_acquire_duration_seconds_count", lockHash, "acquired"); n != 1 {
		t.Errorf("%s: %v acquisitions counted, want 1", lockHash, n)
	}
	if n := count(series, "caddy_redis_ratelimit_requests_total", "logins", "allowed"); n != 3 {
		t.Errorf("logins: %v admissions counted, want 3", n)
	}
	if n := count(series, "caddy_redis_ratelimit_requests_total", rlHash, "allowed"); n != 1 {
		t.Errorf("%s: %v admissions counted, want 1", rlHash, n)
	}

	// Reload with the unnamed limiter's rate changed: the other handlers'
	// series (and counts) stay, the changed one's go, the new one's come.
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(labelsConfig(admin, port, r.Addr, "500 1m")), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	if resp, body := get(t, base+"/a/3"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("GET /a/3 after the reload: %v %q", resp, body)
	}
	series = scrapeMetrics(t, admin)
	byMetric = handlersOf(t, series)
	if n := count(series, "caddy_redis_lock_acquire_duration_seconds_count", "orders", "acquired"); n != 3 {
		t.Errorf("orders after the reload: %v acquisitions counted, want 3 (2 before it, 1 after)", n)
	}
	if n := count(series, "caddy_redis_lock_acquire_duration_seconds_count", lockHash, "acquired"); n != 1 {
		t.Errorf("%s after the reload: %v acquisitions counted, want the 1 from before it", lockHash, n)
	}
	if n := count(series, "caddy_redis_ratelimit_requests_total", "logins", "allowed"); n != 3 {
		t.Errorf("logins after the reload: %v admissions counted, want the 3 from before it", n)
	}
	rlNow := byMetric["caddy_redis_ratelimit_requests_total"]
	newHash := ""
	for h := range rlNow {
		if h != "logins" {
			newHash = h
		}
	}
	if len(rlNow) != 2 || rlNow[rlHash] || !hashedRLLabel.MatchString(newHash) {
		t.Errorf("rate-limit series after the reload carry handlers %v, want logins and a new rl-<hash> (not the old %s)", sortedKeys(rlNow), rlHash)
	}
	for metric, hs := range byMetric {
		if hs[rlHash] {
			t.Errorf("%s still has a series of the replaced handler %s", metric, rlHash)
		}
	}
	if got := byMetric["caddy_redis_evicting_servers"]; len(got) != 4 || !got["orders"] || !got[lockHash] || !got["logins"] || !got[newHash] {
		t.Errorf("caddy_redis_evicting_servers after the reload carries %v, want orders, %s, logins, %s", sortedKeys(got), lockHash, newHash)
	}
}

// TestWholeCaddyLogLinesNameHandler: every log line of the
// plugin names its handler and comes under the handler's module logger,
// also the lines of the parts a pooled client shares between handlers:
// the server check of a Redis that evicts keys warns each handler using
// it, and a release Redis did not answer is logged for the lease's
// handler under http.handlers.redis_lock.
func TestWholeCaddyLogLinesNameHandler(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
	var paused atomic.Bool
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/a/pause" && paused.CompareAndSwap(false, true) {
			r.Pause() // the release after this answer gets no reply
		}
		fmt.Fprint(w, "up")
	}))
	defer up.Close()
	defer func() {
		if paused.Load() {
			r.Resume()
		}
	}()
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	admin, port := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
	log {
		output file %s
		format json
		level DEBUG
	}
}
:%d {
	route /a/* {
		redis_lock {
			name orders
			redis %s
		}
		reverse_proxy %s
	}
	route /b/* {
		redis_lock {
			redis %s
			ttl 20s
		}
		respond "b"
	}
	route /c/* {
		redis_ratelimit {
			name logins
			redis %s
			rate 1000 1m
		}
		respond "c"
	}
	route /d/* {
		redis_ratelimit {
			redis %s
			rate 1000 1m
		}
		respond "d"
	}
}
`, admin, logFile, port, r.Addr, strings.TrimPrefix(up.URL, "http://"), r.Addr, r.Addr, r.Addr))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	for _, p := range []string{"/a/1", "/b/1", "/c/1", "/d/1"} {
		if resp, body := get(t, base+p); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("GET %s: %v %q", p, resp, body)
		}
	}
	series := scrapeMetrics(t, admin)
	byMetric := handlersOf(t, series)
	var lockHash, rlHash string
	for h := range byMetric["caddy_redis_lock_waiters"] {
		if h != "orders" {
			lockHash = h
		}
	}
	for h := range byMetric["caddy_redis_ratelimit_requests_total"] {
		if h != "logins" {
			rlHash = h
		}
	}
	if resp, body := get(t, base+"/a/pause"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("GET /a/pause: %v %q", resp, body)
	}

	type line struct {
		raw    string
		fields map[string]any
	}
	read := func() []line {
		b, err := os.ReadFile(logFile)
		if err != nil {
			t.Fatal(err)
		}
		var out []line
		for _, raw := range strings.Split(string(b), "\n") {
			var f map[string]any
			if json.Unmarshal([]byte(raw), &f) == nil {
				out = append(out, line{raw, f})
			}
		}
		return out
	}
	find := func(lines []line, msg string) []line {
		var out []line
		for _, l := range lines {
			if strings.Contains(fmt.Sprint(l.fields["msg"]), msg) {
				out = append(out, l)
			}
		}
		return out
	}
	var lines []line
	waitFor(30*time.Second, func() bool {
		lines = read()
		return len(find(lines, "releasing a lock failed")) > 0
	})
	r.Resume()
	paused.Store(false)

	rel := find(lines, "releasing a lock failed")
	if len(rel) == 0 {
		t.Fatal("no log line about the release Redis did not answer")
	}
	if l := rel[0]; l.fields["logger"] != "http.handlers.redis_lock" || l.fields["handler"] != "orders" {
		t.Errorf("release failure logged under %v naming handler %v, want http.handlers.redis_lock and orders: %s", l.fields["logger"], l.fields["handler"], l.raw)
	}
	evict := map[string]string{} // handler → logger
	for _, l := range find(lines, "redis server evicts keys") {
		evict[fmt.Sprint(l.fields["handler"])] = fmt.Sprint(l.fields["logger"])
	}
	wantEvict := map[string]string{"orders": "http.handlers.redis_lock", lockHash: "http.handlers.redis_lock",
		"logins": "http.handlers.redis_ratelimit", rlHash: "http.handlers.redis_ratelimit"}
	for h, lg := range wantEvict {
		if evict[h] != lg {
			t.Errorf("eviction error for handler %s under logger %q, want %s (lines: %v)", h, evict[h], lg, evict)
		}
	}
	decisions := map[string]bool{}
	for _, l := range find(lines, "rate limit decision") {
		decisions[fmt.Sprint(l.fields["handler"])] = true
	}
	if !decisions["logins"] || !decisions[rlHash] {
		t.Errorf("rate limit decisions name handlers %v, want logins and %s", sortedKeys(decisions), rlHash)
	}
	for _, l := range lines {
		lg := fmt.Sprint(l.fields["logger"])
		if lg == "redisdlm" || strings.HasPrefix(lg, "redisdlm.") {
			t.Errorf("a line under the bare logger %s: %s", lg, l.raw)
		}
		if !strings.HasPrefix(lg, "http.handlers.redis_") {
			continue
		}
		if n := strings.Count(l.raw, `"handler":`); n != 1 || l.fields["handler"] == "" {
			t.Errorf("a line of %s with %d handler fields: %s", lg, n, l.raw)
		}
	}
}

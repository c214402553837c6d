package redisdlm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
)

// prometheusServer is a real Prometheus scraping the test Caddy.
type prometheusServer struct {
	base string // http://127.0.0.1:<port>
}

// startPrometheus runs Debian's prometheus (apt-get install prometheus;
// `make test` installs it) on a free loopback port, scraping target's
// /metrics every second, until the test ends.
func startPrometheus(t *testing.T, target string) *prometheusServer {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatal("prometheus not found: install it (apt-get install -y prometheus; `make test` does) — this test runs the dashboard's queries on a real Prometheus")
	}
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: caddy
    static_configs:
      - targets: [%q]
`, target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	logf, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin,
		"--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", port))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlives the test binary
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting prometheus: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("prometheus log (tail):\n%s", b)
		}
	})
	p := &prometheusServer{base: fmt.Sprintf("http://127.0.0.1:%d", port)}
	if !waitFor(60*time.Second, func() bool {
		select {
		case <-exited:
			return true
		default:
		}
		resp, err := http.Get(p.base + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	}) {
		t.Fatal("prometheus not ready within 60s")
	}
	select {
	case <-exited:
		t.Fatal("prometheus exited at start")
	default:
	}
	return p
}

// promAnswer is an answer of Prometheus's HTTP API.
type promAnswer struct {
	Status    string `json:"status"`
	ErrorType string `json:"errorType"`
	Error     string `json:"error"`
	Data      json.RawMessage
}

// api calls the HTTP API at path with the query parameters q.
func (p *prometheusServer) api(t *testing.T, path string, q url.Values) promAnswer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", p.base+path+"?"+q.Encode(), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("prometheus %s: %v", path, err)
	}
	defer resp.Body.Close()
	var a promAnswer
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
		t.Fatalf("prometheus %s: decoding the answer: %v", path, err)
	}
	return a
}

// query runs an instant query; it returns the answer and the number of
// samples of its vector result.
func (p *prometheusServer) query(t *testing.T, expr string) (promAnswer, int) {
	t.Helper()
	a := p.api(t, "/api/v1/query", url.Values{"query": {expr}})
	var d struct {
		ResultType string            `json:"resultType"`
		Result     []json.RawMessage `json:"result"`
	}
	_ = json.Unmarshal(a.Data, &d)
	return a, len(d.Result)
}

// dashboardQueries returns the queries of examples/grafana-dashboard.json
// (panel title → expressions) and its variables' definitions.
func dashboardQueries(t *testing.T) (map[string][]string, map[string]string) {
	t.Helper()
	b, err := os.ReadFile("examples/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
		Templating struct {
			List []struct{ Name, Definition string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	panels := map[string][]string{}
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			panels[p.Title] = append(panels[p.Title], tg.Expr)
		}
	}
	vars := map[string]string{}
	for _, v := range dash.Templating.List {
		vars[v.Name] = v.Definition
	}
	return panels, vars
}

var (
	grafanaBuiltin = regexp.MustCompile(`\$\{?__[a-z_]+\}?`)
	grafanaVar     = regexp.MustCompile(`\$\{?([a-zA-Z_][a-zA-Z0-9_]*)\}?`)
	labelValues    = regexp.MustCompile(`^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)
)

// substitute replaces Grafana's variables in expr: its built-in ranges
// ($__rate_interval, ...) by rng, the dashboard's by vars (a regex).
func substitute(expr, rng string, vars map[string]string) string {
	expr = grafanaBuiltin.ReplaceAllString(expr, rng)
	return grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		name := grafanaVar.FindStringSubmatch(m)[1]
		if v, ok := vars[name]; ok {
			return v
		}
		return m
	})
}

// TestDashboardQueriesOnPrometheus: a real Prometheus scrapes the admin
// /metrics endpoint of a Caddy running every handler kind (two lock
// handlers, two limiters, a fence; one of each kind named); every query of
// the Grafana dashboard parses and returns data there, with its variables
// set to all handlers and to one named handler, and the handler variable
// lists every handler.
func TestDashboardQueriesOnPrometheus(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	admin, port := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
}
:%d {
	route /a/* {
		redis_lock {
			name orders
			redis %s
			replay 1m
		}
		respond "a"
	}
	route /b/* {
		redis_lock {
			redis %s
		}
		respond "b"
	}
	route /c/* {
		redis_ratelimit {
			name logins
			redis %s
			rate 2 1m
		}
		respond "c"
	}
	route /d/* {
		redis_ratelimit {
			redis %s
			rate 1000 1m
			wait 1s
		}
		respond "d"
	}
	route /f/* {
		redis_fence {
			name storage
			redis %s
		}
		respond "f"
	}
}
`, admin, port, r.Addr, r.Addr, r.Addr, r.Addr, r.Addr))
	prom := startPrometheus(t, fmt.Sprintf("localhost:%d", admin))
	if !waitFor(60*time.Second, func() bool {
		_, n := prom.query(t, `up{job="caddy"} == 1`)
		return n == 1
	}) {
		t.Fatal("prometheus did not scrape the Caddy admin endpoint within 60s")
	}

	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	traffic := func() {
		for i := 0; i < 3; i++ {
			for _, p := range []string{"/a/1", "/b/1", "/c/1", "/d/1"} {
				get(t, fmt.Sprintf("%s%s?%d", base, p, i))
			}
			get(t, base+"/f/1", redislock.DefaultFencingHeader, "1")
		}
	}
	traffic()
	// rate() needs two samples after the traffic in its range.
	if !waitFor(60*time.Second, func() bool {
		_, n := prom.query(t, `count_over_time(caddy_redis_ratelimit_requests_total{handler="logins",result="denied"}[1m]) >= 3`)
		return n == 1
	}) {
		t.Fatal("prometheus did not get three scrapes of the traffic within 60s")
	}
	traffic()
	scrapes := func() int {
		a, _ := prom.query(t, `count_over_time(up{job="caddy"}[1m])`)
		var d struct {
			Result []struct{ Value []any } `json:"result"`
		}
		_ = json.Unmarshal(a.Data, &d)
		if len(d.Result) == 0 || len(d.Result[0].Value) < 2 {
			return 0
		}
		var n int
		fmt.Sscan(fmt.Sprint(d.Result[0].Value[1]), &n)
		return n
	}
	before := scrapes()
	waitFor(30*time.Second, func() bool { return scrapes() >= before+2 })

	panels, vars := dashboardQueries(t)
	if len(panels) == 0 {
		t.Fatal("the dashboard has no queries")
	}
	if _, ok := vars["handler"]; !ok {
		t.Fatal("the dashboard has no handler variable")
	}
	for _, handler := range []string{".*", "orders|logins|storage"} {
		settings := map[string]string{"instance": ".*", "handler": handler}
		for title, exprs := range panels {
			for _, expr := range exprs {
				q := substitute(expr, "1m", settings)
				a, n := prom.query(t, q)
				switch {
				case a.Status != "success":
					t.Errorf("panel %q, handler %s: query %s: %s %s: %s", title, handler, q, a.Status, a.ErrorType, a.Error)
				case n == 0:
					t.Errorf("panel %q, handler %s: query %s returned no data", title, handler, q)
				}
			}
		}
	}

	// The handler variable: label_values(<selector>, handler).
	m := labelValues.FindStringSubmatch(vars["handler"])
	if m == nil || m[2] != "handler" {
		t.Fatalf("handler variable %q: want label_values(<series>, handler)", vars["handler"])
	}
	a := prom.api(t, "/api/v1/label/handler/values", url.Values{"match[]": {substitute(m[1], "1m", map[string]string{"instance": ".*"})}})
	var values []string
	if err := json.Unmarshal(a.Data, &values); a.Status != "success" || err != nil {
		t.Fatalf("handler variable's values: %s %s %v", a.Status, a.Error, err)
	}
	got := strings.Join(values, " ")
	for _, want := range []*regexp.Regexp{regexp.MustCompile(`\borders\b`), hashedLockLabel, regexp.MustCompile(`\blogins\b`), hashedRLLabel, regexp.MustCompile(`\bstorage\b`)} {
		found := false
		for _, v := range values {
			if want.MatchString(v) {
				found = true
			}
		}
		if !found {
			t.Errorf("the handler variable lists %q, none matching %s", got, want)
		}
	}
	if len(values) != 5 {
		t.Errorf("the handler variable lists %d handlers (%s), want the 5 of the config", len(values), got)
	}
}

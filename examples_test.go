package redisdlm

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// comingMetrics are metrics the dashboard may show before the plugin
// exports them (work landing meanwhile), with their types; empty now that
// every metric it shows is exported. An entry that is exported fails the test.
var comingMetrics = map[string]string{}

// exportedMetrics reads the names and types of the Prometheus collectors the
// plugin creates: every prometheus.New<Type>(...Opts{Name: "caddy_redis_..."})
// in the non-test Go files of the module's packages.
func exportedMetrics(t *testing.T) map[string]string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{"internal/*", "*"} {
		more, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, more...)
	}
	out := map[string]string{}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || !strings.HasPrefix(sel.Sel.Name, "New") {
				return true
			}
			if pkg, ok := sel.X.(*ast.Ident); !ok || pkg.Name != "prometheus" {
				return true
			}
			kind := strings.ToLower(strings.TrimSuffix(strings.TrimPrefix(sel.Sel.Name, "New"), "Vec"))
			for _, arg := range call.Args {
				lit, ok := arg.(*ast.CompositeLit)
				if !ok {
					continue
				}
				for _, el := range lit.Elts {
					kv, ok := el.(*ast.KeyValueExpr)
					if !ok {
						continue
					}
					if k, ok := kv.Key.(*ast.Ident); ok && k.Name == "Name" {
						if v, ok := kv.Value.(*ast.BasicLit); ok {
							s, _ := strconv.Unquote(v.Value)
							out[s] = kind
						}
					}
				}
			}
			return true
		})
	}
	if len(out) == 0 {
		t.Fatal("found no Prometheus collector in the module")
	}
	return out
}

var metricRef = regexp.MustCompile(`\bcaddy_redis_[a-z_]+`)

// seriesOf maps a series name in a query to its metric and checks the
// suffix fits the metric's type (_bucket, _sum, _count: histograms only).
func seriesOf(series string, known map[string]string) (string, bool) {
	if _, ok := known[series]; ok {
		return series, true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		base := strings.TrimSuffix(series, suf)
		if base != series && known[base] == "histogram" {
			return base, true
		}
	}
	return "", false
}

// TestGrafanaDashboard: every query of examples/grafana-dashboard.json names
// a metric the plugin exports (or one of the explicit comingMetrics), every
// panel says what question it answers, and the panels the README promises
// are there.
func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("examples/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Type, Title, Description string
			Targets                  []struct{ Expr string }
		}
		Templating struct {
			List []struct{ Definition string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("examples/grafana-dashboard.json: %v", err)
	}
	exported := exportedMetrics(t)
	known := map[string]string{}
	for name, kind := range exported {
		known[name] = kind
	}
	for name, kind := range comingMetrics {
		if _, ok := exported[name]; ok {
			t.Errorf("%s is exported now: remove it from comingMetrics", name)
		}
		known[name] = kind
	}
	used := map[string]bool{}
	check := func(where, expr string) {
		refs := metricRef.FindAllString(expr, -1)
		if len(refs) == 0 {
			t.Errorf("%s: query %q names no caddy_redis_* metric", where, expr)
		}
		for _, ref := range refs {
			m, ok := seriesOf(ref, known)
			if !ok {
				t.Errorf("%s: query names %s, which the plugin does not export (exported: %v)", where, ref, exported)
				continue
			}
			used[m] = true
		}
	}
	queries := 0
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		if strings.TrimSpace(p.Description) == "" || !strings.Contains(p.Description, "?") {
			t.Errorf("panel %q: its description should ask the question it answers", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			queries++
			check("panel "+strconv.Quote(p.Title), tg.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		if v.Definition != "" {
			check("variable", v.Definition)
		}
	}
	for _, m := range []string{
		"caddy_redis_lock_acquire_duration_seconds", "caddy_redis_lock_held_duration_seconds",
		"caddy_redis_lock_waiters", "caddy_redis_lock_lost_total", "caddy_redis_ratelimit_requests_total",
		"caddy_redis_lock_replays_total", "caddy_redis_ratelimit_waited_seconds", "caddy_redis_evicting_servers",
	} {
		if !used[m] {
			t.Errorf("no panel shows %s", m)
		}
	}
	t.Logf("%d panels, %d queries", len(dash.Panels), queries)
}

// TestExamplesHideServerErrors: no example Caddyfile answers a server error
// (5xx, e.g. 503 when Redis is unreachable) with the error's message, which
// can name internal Redis addresses: handle_errors routes that show
// {http.error.message} must match 4xx statuses only.
func TestExamplesHideServerErrors(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("examples/*Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	rangeRe := regexp.MustCompile(`\{http\.error\.status_code\} >= \d+ && \{http\.error\.status_code\} <= (\d+)`)
	inRe := regexp.MustCompile(`\{http\.error\.status_code\} in \[([\d, ]+)\]`)
	clientOnly := func(match []any) bool {
		for _, m := range match {
			expr, _ := m.(map[string]any)["expression"].(string)
			if g := rangeRe.FindStringSubmatch(expr); g != nil {
				if hi, _ := strconv.Atoi(g[1]); hi < 500 {
					return true
				}
			}
			if g := inRe.FindStringSubmatch(expr); g != nil {
				ok := true
				for _, c := range strings.Split(g[1], ",") {
					if n, _ := strconv.Atoi(strings.TrimSpace(c)); n >= 500 {
						ok = false
					}
				}
				if ok {
					return true
				}
			}
		}
		return false
	}
	for _, f := range files {
		in, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(in, map[string]any{"filename": f})
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		var cfg struct {
			Apps struct {
				HTTP struct {
					Servers map[string]struct {
						Errors struct {
							Routes []map[string]any
						}
					}
				}
			}
		}
		if err := json.Unmarshal(out, &cfg); err != nil {
			t.Fatal(err)
		}
		for name, srv := range cfg.Apps.HTTP.Servers {
			for i, route := range srv.Errors.Routes {
				handle, _ := json.Marshal(route["handle"])
				if !strings.Contains(string(handle), "{http.error.message}") && !strings.Contains(string(handle), "{err.message}") {
					continue
				}
				match, _ := route["match"].([]any)
				if !clientOnly(match) {
					t.Errorf("%s, server %s, error route %d: shows the error message for any status, also 5xx; limit it to 4xx (handle_errors 4xx)", f, name, i)
				}
			}
		}
	}
}

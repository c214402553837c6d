package redisdlm

import (
	"os/exec"
	"strings"
	"testing"
)

// TestEnginesImportNoHTTPOrCaddy fails when a package under internal/
// depends, directly or not, on net/http or any Caddy package: the engines
// must be readable, testable and changeable without them. The test helper
// (internal/testredis) may depend on what tests need, but not on Caddy;
// internal/shared is the handlers' Caddy side, not an engine.
func TestEnginesImportNoHTTPOrCaddy(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "./internal/...").Output()
	if err != nil {
		t.Fatalf("go list ./internal/...: %v", err)
	}
	pkgs := strings.Fields(string(out))
	if len(pkgs) < 2 {
		t.Fatalf("go list ./internal/... found %v, want the engine packages", pkgs)
	}
	for _, pkg := range pkgs {
		if strings.HasSuffix(pkg, "/internal/shared") || strings.HasSuffix(pkg, "/internal/testkit") {
			continue // the handlers' Caddy side and their tests' kit: not engines
		}
		helper := strings.HasSuffix(pkg, "/internal/testredis")
		out, err := exec.Command("go", "list", "-deps", pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			caddy := strings.HasPrefix(dep, "github.com/caddyserver/")
			http := dep == "net/http" || strings.HasPrefix(dep, "net/http/")
			if caddy || http && !helper {
				t.Errorf("%s depends on %s; the engines under internal/ must not depend on HTTP or Caddy", pkg, dep)
			}
		}
	}
}

// TestModulePackagesImportNoOther fails when the package of one Caddy
// module (redislock, redisfence, redisadmin, ...) depends on another's:
// what they share lives in internal/shared.
func TestModulePackagesImportNoOther(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}", "./...").Output()
	if err != nil {
		t.Fatalf("go list ./...: %v", err)
	}
	const root = "github.com/caddy-dlm/redisdlm"
	modules := map[string]bool{}
	for _, pkg := range strings.Fields(string(out)) {
		if rest, ok := strings.CutPrefix(pkg, root+"/"); ok && !strings.Contains(rest, "/") && rest != "internal" {
			modules[pkg] = true
		}
	}
	if len(modules) < 3 {
		t.Fatalf("module packages %v, want the lock's, the fence's and the admin API's at least", modules)
	}
	for pkg := range modules {
		out, err := exec.Command("go", "list", "-deps", pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			if dep != pkg && modules[dep] {
				t.Errorf("%s depends on %s; a module package must not import another", pkg, dep)
			}
		}
	}
}

package redisdlm

import (
	"go/parser"
	"go/token"
	"strconv"
	"strings"
	"testing"
)

// engineFiles are the lock engine: they must know nothing of HTTP or Caddy,
// so the engine can be read, tested and changed on its own.
var engineFiles = []string{"redlock.go", "attempt.go", "quorum.go", "lease.go", "release.go", "queue.go", "wake.go", "script.go"}

// TestEngineImportsNoHTTPOrCaddy fails when an engine file imports net/http
// or any Caddy package.
func TestEngineImportsNoHTTPOrCaddy(t *testing.T) {
	t.Parallel()
	fset := token.NewFileSet()
	for _, name := range engineFiles {
		f, err := parser.ParseFile(fset, name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatalf("parsing %s: %v", name, err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(path, "net/http") || strings.HasPrefix(path, "github.com/caddyserver/") {
				t.Errorf("%s imports %s; the lock engine must not depend on HTTP or Caddy", name, path)
			}
		}
	}
}

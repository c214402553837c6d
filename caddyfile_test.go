package redisdlm

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestCaddyfileGolden adapts every testdata/*.caddyfile (both directives)
// and every examples/*Caddyfile, and compares the JSON with its golden file
// (testdata/<name>.json, testdata/examples/<name>.json; UPDATE_GOLDEN=1
// rewrites them), so neither the parser nor the examples can drift
// unnoticed. It also checks that {client_ip} becomes {http.vars.client_ip}.
func TestCaddyfileGolden(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("testdata/*.caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata/*.caddyfile: %v", err)
	}
	examples, err := filepath.Glob("examples/*Caddyfile")
	if err != nil || len(examples) == 0 {
		t.Fatalf("no examples/*Caddyfile: %v", err)
	}
	adapter := caddyconfig.GetAdapter("caddyfile")
	for _, f := range append(files, examples...) {
		golden := strings.TrimSuffix(f, ".caddyfile") + ".json"
		if strings.HasPrefix(f, "examples/") {
			golden = filepath.Join("testdata", "examples", strings.TrimSuffix(filepath.Base(f), ".Caddyfile")+".json")
		}
		t.Run(f, func(t *testing.T) {
			in, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			out, warnings, err := adapter.Adapt(in, map[string]any{"filename": f})
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			if len(warnings) > 0 {
				t.Fatalf("adapt warnings: %v", warnings)
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, out, "", "\t"); err != nil {
				t.Fatal(err)
			}
			pretty.WriteByte('\n')
			if os.Getenv("UPDATE_GOLDEN") != "" {
				_ = os.MkdirAll(filepath.Dir(golden), 0o755)
				if err := os.WriteFile(golden, pretty.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with UPDATE_GOLDEN=1 to create it)", err)
			}
			if !bytes.Equal(pretty.Bytes(), want) {
				t.Fatalf("adapted JSON differs from %s:\n%s", golden, pretty.String())
			}
			if strings.Contains(pretty.String(), "{client_ip}") {
				t.Fatal("{client_ip} shorthand left unexpanded")
			}
		})
	}
}

// TestRateLimitDirectiveOrder: without an `order` option, authentication
// runs before redis_ratelimit, which runs before redis_lock and respond.
func TestRateLimitDirectiveOrder(t *testing.T) {
	t.Parallel()
	in := "example.com {\n\trespond ok\n\tredis_lock /x/* {\n\t\tkey {path}\n\t}\n\tencode gzip\n\trequest_header X-Seen yes\n\tredis_ratelimit {\n\t\trate 5 10s\n\t}\n\tbasic_auth {\n\t\talice $2a$14$Zkx19XLiW6VYouLHR5NmfOFU0z2GTNmpkT/5qqR7hx4IjWJPDhjvG\n\t}\n}\n"
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(in), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	// encode wraps the lock: a replayed answer is compressed for the
	// client it answers, never stored compressed.
	order := []string{`"handler":"authentication"`, `"handler":"redis_ratelimit"`, `"handler":"headers"`, `"handler":"encode"`, `"handler":"redis_lock"`, `"handler":"static_response"`}
	last := -1
	for _, h := range order {
		i := strings.Index(s, h)
		if i < 0 || i < last {
			t.Fatalf("handler order wrong at %s in %s", h, s)
		}
		last = i
	}
}

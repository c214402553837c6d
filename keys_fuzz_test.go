package redisdlm

import (
	"errors"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// FuzzStoredKey: every rendered key maps to a Redis key whose hash tag
// covers the whole key (one Cluster slot for the lock, its counter and its
// wait list), and different keys never share a Redis key.
func FuzzStoredKey(f *testing.F) {
	for _, s := range []string{"alice", "a}b", "{x}", "sha256:00", strings.Repeat("y", 250)} {
		f.Add(s, "other")
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		ka, kb := shared.StoredKey("p:", a), shared.StoredKey("p:", b)
		if a != b && ka == kb {
			t.Fatalf("keys %q and %q share the Redis key %q", a, b, ka)
		}
		open := strings.IndexByte(ka, '{')
		close := strings.IndexByte(ka[open+1:], '}')
		if open < 0 || close < 0 || open+1+close != len(ka)-1 {
			t.Fatalf("Redis key %q: the hash tag must span the whole key", ka)
		}
		if len(ka) > len("p:{}")+shared.MaxKeyLen {
			t.Fatalf("Redis key %q longer than the bound", ka)
		}
	})
}

// FuzzKeyRender: any key template is compiled or refused without a panic;
// a compiled one renders any header and path into a Redis key whose hash
// tag spans the whole key and whose length is bounded, for the lock and the
// rate limiter alike; a placeholder that renders empty is an error, never a
// shorter key.
func FuzzKeyRender(f *testing.F) {
	for _, s := range [][3]string{
		{"{http.request.header.X-U}", "alice", "/a"},
		{"user:{http.request.header.X-U}", "", "/a"},
		{"{path}:{header.X-U}", "b}{c", "/p{q}"},
		{"{http.request.uri.path}", "", strings.Repeat("/x", 300)},
		{"lit\\{eral\\}", "", "/"},
		{"{unknown.ns}", "a", "/"},
		{"{http.request.header.X-U", "a", "/"},
		{"sha256:{http.request.header.X-U}", "00", "/"},
	} {
		f.Add(s[0], s[1], s[2])
	}
	f.Fuzz(func(t *testing.T, tmpl, hdr, path string) {
		kt, err := shared.ParseKeyTemplate(tmpl)
		if err != nil {
			return
		}
		r := &http.Request{Method: "GET", URL: &url.URL{Path: path}, Header: http.Header{"X-U": {hdr}}, Host: "h"}
		repl := caddyhttp.NewTestReplacer(r)
		k, err := kt.Render(repl)
		if err != nil {
			if !errors.Is(err, shared.ErrKeyEmpty) && !errors.Is(err, shared.ErrKeyUnknown) {
				t.Fatalf("render %q: unexpected error %v", tmpl, err)
			}
			return
		}
		if k == "" {
			t.Fatalf("template %q rendered an empty key without an error", tmpl)
		}
		for _, rk := range []string{shared.StoredKey("caddy:lock:", k), "caddy:rl:{" + limitIDFor(k, "") + "}"} {
			open, closing := strings.IndexByte(rk, '{'), strings.IndexByte(rk, '}')
			if open < 0 || closing != len(rk)-1 || strings.Count(rk, "{") != 1 {
				t.Fatalf("key %q: Redis key %q breaks the hash tag", k, rk)
			}
			if len(rk) > len("caddy:lock:{}")+shared.MaxKeyLen {
				t.Fatalf("key %q: Redis key of %d bytes, over the bound", k, len(rk))
			}
		}
	})
}

package redisratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// FuzzRateLimitCaddyfile: the parser never panics, its errors name the
// directive, and what it accepts passes Validate and round-trips
// Caddyfile → JSON → Provision.
func FuzzRateLimitCaddyfile(f *testing.F) {
	for _, s := range []string{
		"redis_ratelimit {\n rate 10 1s\n}",
		"redis_ratelimit {\n rate 10 1s\n rate 100 1h\n algorithm gcra\n burst 5\n key {client_ip}\n}",
		"redis_ratelimit {\n rate 0 1s\n status 99\n}",
		"redis_ratelimit {\n redis redis://:x@h:1/2\n rate 1 1ms\n prefix p:\n headers off\n dry_run\n}",
		"redis_ratelimit {\n sentinel m 127.0.0.1:26379 127.0.0.1:26380\n rate 5 1s\n fail_closed\n status 503\n timeout 100ms\n}",
		"redis_ratelimit {\n cluster 127.0.0.1:7000\n key {http.auth.user.id}\n rate 100000 1h\n}",
		"redis_ratelimit {\n redis redis//h:1\n rate 1 1s\n}",
		"redis_ratelimit {\n rate {plan_rpm} 1m\n rate 10 {http.vars.w}\n cost {http.vars.cost}\n count 401 5xx\n wait 2s\n}",
		"redis_ratelimit {\n rate 5 1s\n cost 6\n count 99\n wait -1s\n}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		tokens, err := caddyfile.Tokenize([]byte(in), "Testfile")
		if err != nil {
			return
		}
		var h RedisRateLimit
		if err := h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
			if len(tokens) > 0 && tokens[0].Text == "redis_ratelimit" {
				testkit.CheckParseError(t, "redis_ratelimit", err)
			}
			return
		}
		if strings.Contains(in, "{env.") || strings.Contains(in, "{file.") {
			return
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("parser accepted %q but Validate rejects it: %v", in, err)
		}
		testkit.CheckRoundTrip(t, "redis_ratelimit", &h, &h.RedisConfig, new(RedisRateLimit))
	})
}

// FuzzRateLimitKey: a rendered key maps to an id without braces and of
// bounded length, and distinct keys never share an id.
func FuzzRateLimitKey(f *testing.F) {
	f.Add("alice", "bob")
	f.Add("", "ip/192.0.2.1")
	f.Add(strings.Repeat("x", 300), "sha256:")
	f.Fuzz(func(t *testing.T, a, b string) {
		ia, ib := limitIDFor(a, "192.0.2.1"), limitIDFor(b, "192.0.2.1")
		for _, id := range []string{ia, ib} {
			if strings.ContainsAny(id, "{}") || len(id) > shared.MaxKeyLen+7 {
				t.Fatalf("id %q breaks the hash tag or is too long", id)
			}
		}
		if a != b && ia == ib {
			t.Fatalf("keys %q and %q share the id %q", a, b, ia)
		}
	})
}

// FuzzRateLimitHeaders: for any rate a handler accepts and any wait, the
// answer's fields are well formed: RateLimit-Policy `"r0";q=<n>;w=<s>`
// (w = the window in whole seconds, rounded up), RateLimit
// `"r0";r=<remaining>;t=<s>`, and Retry-After whole seconds ≥ 1 and never
// before the wait ends. The rejection is answered from the deny cache, so
// no Redis is needed.
func FuzzRateLimitHeaders(f *testing.F) {
	f.Add(uint32(10), int64(time.Minute), int64(1500*time.Millisecond), false)
	f.Add(uint32(1), int64(time.Millisecond), int64(time.Nanosecond), true)
	f.Add(uint32(100000), int64(24*time.Hour), int64(23*time.Hour), false)
	f.Add(uint32(7), int64(1500*time.Millisecond), int64(0), true)
	policyRE := regexp.MustCompile(`^"r0";q=([0-9]+);w=([0-9]+)$`)
	fieldRE := regexp.MustCompile(`^"r0";r=([0-9]+);t=([0-9]+)$`)
	f.Fuzz(func(t *testing.T, n uint32, window, wait int64, gcra bool) {
		h := &RedisRateLimit{Key: "k", Rates: []Rate{{Requests: int(n), Window: caddy.Duration(window)}}}
		h.Addresses = []string{"127.0.0.1:1"}
		if gcra {
			h.Algorithm = algoGCRA
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		err := h.Provision(ctx)
		defer h.Cleanup()
		if err != nil {
			if !strings.Contains(err.Error(), "redis_ratelimit") {
				t.Fatalf("provision error does not name the directive: %v", err)
			}
			return
		}
		quietRateLimit(h)
		now := time.Now()
		if wait < int64(time.Millisecond) || wait > int64(1000*time.Hour) {
			wait = int64(time.Millisecond)
		}
		h.deny.Put("k", ratelimit.DenyEntry{Until: now.Add(time.Duration(wait)), RetryAt: now.Add(time.Duration(wait)), Tight: 0})
		req := httptest.NewRequest("GET", "/", nil)
		req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
		w := httptest.NewRecorder()
		err = h.ServeHTTP(w, req, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil }))
		if err == nil {
			return // the cached rejection ran out already
		}
		m := policyRE.FindStringSubmatch(w.Header().Get(HeaderRateLimitPolicy))
		if m == nil || m[1] != strconv.FormatUint(uint64(n), 10) || m[2] != strconv.FormatInt(shared.CeilSeconds(time.Duration(window)), 10) {
			t.Fatalf("RateLimit-Policy %q for rate %d %s", w.Header().Get(HeaderRateLimitPolicy), n, time.Duration(window))
		}
		if !fieldRE.MatchString(w.Header().Get(HeaderRateLimit)) {
			t.Fatalf("RateLimit %q", w.Header().Get(HeaderRateLimit))
		}
		ra, err := strconv.ParseInt(w.Header().Get(HeaderRetryAfter), 10, 64)
		if err != nil || ra < 1 || time.Duration(ra)*time.Second < time.Duration(wait)-time.Since(now) {
			t.Fatalf("Retry-After %q for a wait of %s", w.Header().Get(HeaderRetryAfter), time.Duration(wait))
		}
	})
}

// FuzzRateLimitPlanJSON: a rate or cost in JSON never panics, and what
// decodes survives a round trip (literals stay numbers, placeholders
// strings).
func FuzzRateLimitPlanJSON(f *testing.F) {
	for _, s := range []string{
		`{"requests":100,"window":60000000000}`,
		`{"requests":"{plan_rpm}","window":"1m"}`,
		`{"requests":"5","window":"{http.vars.w}"}`,
		`{"requests":1.5,"window":"x"}`,
		`{"requests":"{a","window":null}`,
	} {
		f.Add(s, "3")
	}
	f.Add(`{"requests":1,"window":1}`, `"{http.vars.cost}"`)
	f.Add(`{}`, `1e3`)
	f.Fuzz(func(t *testing.T, rate, cost string) {
		var r Rate
		if err := json.Unmarshal([]byte(rate), &r); err == nil {
			b, err := json.Marshal(r)
			if err != nil {
				t.Fatalf("marshal %+v: %v", r, err)
			}
			var back Rate
			if err := json.Unmarshal(b, &back); err != nil || back != r {
				t.Fatalf("round trip of %s: %s gives %+v (%v), want %+v", rate, b, back, err, r)
			}
		}
		var c IntOrPlaceholder
		if err := json.Unmarshal([]byte(cost), &c); err == nil {
			b, err := json.Marshal(c)
			if err != nil {
				t.Fatalf("marshal cost %q: %v", c, err)
			}
			var back IntOrPlaceholder
			if err := json.Unmarshal(b, &back); err != nil || back != c {
				t.Fatalf("round trip of cost %s: %s gives %q (%v)", cost, b, back, err)
			}
		}
	})
}

// FuzzRateLimitCount: count's statuses never panic; what parses matches
// exactly the codes listed (or their classes).
func FuzzRateLimitCount(f *testing.F) {
	for _, s := range []string{"401", "401 403", "5xx", "4XX 200", "99", "600", "1xx 599", "abc", "-1", "4x"} {
		f.Add(s, 404)
	}
	f.Fuzz(func(t *testing.T, list string, status int) {
		args := strings.Fields(list)
		set, err := parseStatusSet(args)
		if err != nil {
			return
		}
		want := false
		for _, a := range args {
			a = strings.ToLower(a)
			if n, err := strconv.Atoi(a); err == nil && n == status {
				want = true
			}
			if len(a) == 3 && a[1:] == "xx" && status >= 100 && status <= 599 && int(a[0]-'0') == status/100 {
				want = true
			}
		}
		if len(args) > 0 && set.has(status) != want {
			t.Fatalf("count %q: has(%d) = %v, want %v", list, status, set.has(status), want)
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

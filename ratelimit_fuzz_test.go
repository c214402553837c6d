package redisdlm

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzRateLimitCaddyfile: the parser never panics, and what it accepts
// passes Validate.
func FuzzRateLimitCaddyfile(f *testing.F) {
	for _, s := range []string{
		"redis_ratelimit {\n rate 10 1s\n}",
		"redis_ratelimit {\n rate 10 1s\n rate 100 1h\n algorithm gcra\n burst 5\n key {client_ip}\n}",
		"redis_ratelimit {\n rate 0 1s\n status 99\n}",
		"redis_ratelimit {\n redis redis://:x@h:1/2\n rate 1 1ms\n prefix p:\n headers off\n dry_run\n}",
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
			return
		}
		if strings.Contains(in, "{env.") || strings.Contains(in, "{file.") {
			return
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("parser accepted %q but Validate rejects it: %v", in, err)
		}
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
			if strings.ContainsAny(id, "{}") || len(id) > maxKeyLen+7 {
				t.Fatalf("id %q breaks the hash tag or is too long", id)
			}
		}
		if a != b && ia == ib {
			t.Fatalf("keys %q and %q share the id %q", a, b, ia)
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

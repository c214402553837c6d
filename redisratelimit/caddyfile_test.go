package redisratelimit

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard" // basic_auth, trusted_proxies static
)

func TestRateLimitCaddyfileParse(t *testing.T) {
	t.Parallel()
	off := false
	for _, tc := range []struct {
		name  string
		input string
		want  RedisRateLimit
	}{
		{"minimal", `redis_ratelimit {
			rate 100 1m
		}`, RedisRateLimit{Rates: []Rate{{Requests: 100, Window: caddy.Duration(time.Minute)}}}},
		{"everything", `redis_ratelimit {
			key       {http.request.header.X-API-Key}
			rate      10 1s
			rate      1000 1h
			algorithm gcra
			burst     20
			status    503
			headers   off
			dry_run
			fail_closed
			prefix    api:rl:
			redis     redis://:secret@10.0.0.1:6380/2
			timeout   250ms
		}`, RedisRateLimit{
			Key:       "{http.request.header.X-API-Key}",
			Rates:     []Rate{{Requests: 10, Window: caddy.Duration(time.Second)}, {Requests: 1000, Window: caddy.Duration(time.Hour)}},
			Algorithm: "gcra", Burst: 20, Status: 503, Headers: &off, DryRun: true, FailClosed: true, Prefix: "api:rl:",
			RedisConfig: shared.RedisConfig{Addresses: []string{"redis://:secret@10.0.0.1:6380/2"}, Timeout: caddy.Duration(250 * time.Millisecond)},
		}},
		{"ban", `redis_ratelimit {
			rate 5 10m
			ban  1h
		}`, RedisRateLimit{Rates: []Rate{{Requests: 5, Window: caddy.Duration(10 * time.Minute)}}, Ban: caddy.Duration(time.Hour)}},
		{"burst before algorithm", `redis_ratelimit {
			burst 5
			rate 1 1s
			algorithm gcra
		}`, RedisRateLimit{Burst: 5, Algorithm: "gcra", Rates: []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}}},
		{"large n with gcra", `redis_ratelimit {
			rate 1000000 1h
			algorithm gcra
		}`, RedisRateLimit{Algorithm: "gcra", Rates: []Rate{{Requests: 1000000, Window: caddy.Duration(time.Hour)}}}},
		{"cluster", `redis_ratelimit {
			rate 1 1s
			cluster 10.0.0.1:7000 10.0.0.2:7000
		}`, RedisRateLimit{Rates: []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}, RedisConfig: shared.RedisConfig{Cluster: []string{"10.0.0.1:7000", "10.0.0.2:7000"}}}},
		{"plans, cost, count, wait", `redis_ratelimit {
			rate  {plan_rpm} 1m
			rate  1000 {http.vars.window}
			cost  {http.vars.cost}
			count 401 403 5xx
			count 429
			wait  2s
		}`, RedisRateLimit{
			Rates: []Rate{mustRate("{plan_rpm}", "1m"), mustRate("1000", "{http.vars.window}")},
			Cost:  "{http.vars.cost}", Count: []string{"401", "403", "5xx", "429"}, Wait: caddy.Duration(2 * time.Second),
		}},
		{"literal cost", `redis_ratelimit {
			rate 10 1s
			cost 3
		}`, RedisRateLimit{Rates: []Rate{{Requests: 10, Window: caddy.Duration(time.Second)}}, Cost: "3"}},
		{"env password", `redis_ratelimit {
			rate 1 1s
			password {env.REDIS_PASSWORD}
		}`, RedisRateLimit{Rates: []Rate{{Requests: 1, Window: caddy.Duration(time.Second)}}, RedisConfig: shared.RedisConfig{Password: "{env.REDIS_PASSWORD}"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got RedisRateLimit
			if err := got.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				g, _ := json.Marshal(got)
				w, _ := json.Marshal(tc.want)
				t.Fatalf("got  %s\nwant %s", g, w)
			}
		})
	}
}

func mustRate(n, w string) Rate {
	r, err := RateOf(n, w)
	if err != nil {
		panic(err)
	}
	return r
}

// TestRateLimitCaddyfileErrors: every bad input fails with a message naming
// the directive, the subdirective and the line.
func TestRateLimitCaddyfileErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		input string
		want  []string // substrings of the error
	}{
		{"unknown subdirective", "redis_ratelimit {\n rate 1 1s\n frobnicate 3\n}", []string{`unknown subdirective "frobnicate"`, "Testfile:3"}},
		{"argument on the directive", "redis_ratelimit foo {\n rate 1 1s\n}", []string{"unexpected argument", "Testfile:1"}},
		{"no rate", "redis_ratelimit {\n key {client_ip}\n}", []string{"rate"}},
		{"rate missing window", "redis_ratelimit {\n rate 10\n}", []string{"rate:", "<n> <window>", "Testfile:2"}},
		{"rate extra arg", "redis_ratelimit {\n rate 10 1s 5\n}", []string{"rate:", "Testfile:2"}},
		{"rate zero count", "redis_ratelimit {\n rate 0 1s\n}", []string{"rate:", ">= 1", "Testfile:2"}},
		{"rate negative count", "redis_ratelimit {\n rate -3 1s\n}", []string{"rate:", "Testfile:2"}},
		{"rate bad count", "redis_ratelimit {\n rate ten 1s\n}", []string{"rate:", `"ten"`, "Testfile:2"}},
		{"rate zero window", "redis_ratelimit {\n rate 10 0s\n}", []string{"rate:", "window", "Testfile:2"}},
		{"rate bad window", "redis_ratelimit {\n rate 10 soon\n}", []string{"rate:", "invalid duration", "Testfile:2"}},
		{"sliding n too large", "redis_ratelimit {\n rate 100001 1h\n key {client_ip}\n}", []string{"rate:", "100000", "gcra", "Testfile:2"}},
		{"gcra too fast", "redis_ratelimit {\n algorithm gcra\n rate 5000 1ms\n}", []string{"rate:", "microsecond", "Testfile:3"}},
		{"bad algorithm", "redis_ratelimit {\n rate 1 1s\n algorithm token_bucket\n}", []string{"algorithm:", "Testfile:3"}},
		{"algorithm no arg", "redis_ratelimit {\n rate 1 1s\n algorithm\n}", []string{"algorithm:", "Testfile:3"}},
		{"burst without gcra", "redis_ratelimit {\n rate 1 1s\n burst 5\n}", []string{"burst:", "gcra", "Testfile:3"}},
		{"burst zero", "redis_ratelimit {\n algorithm gcra\n rate 1 1s\n burst 0\n}", []string{"burst:", "Testfile:4"}},
		{"burst negative", "redis_ratelimit {\n algorithm gcra\n rate 1 1s\n burst -2\n}", []string{"burst:", "Testfile:4"}},
		{"burst not a number", "redis_ratelimit {\n algorithm gcra\n rate 1 1s\n burst lots\n}", []string{"burst:", "Testfile:4"}},
		{"status low", "redis_ratelimit {\n rate 1 1s\n status 302\n}", []string{"status:", "400-599", "Testfile:3"}},
		{"status high", "redis_ratelimit {\n rate 1 1s\n status 600\n}", []string{"status:", "Testfile:3"}},
		{"status extra", "redis_ratelimit {\n rate 1 1s\n status 429 503\n}", []string{"status:", "Testfile:3"}},
		{"headers bad", "redis_ratelimit {\n rate 1 1s\n headers maybe\n}", []string{"headers:", "Testfile:3"}},
		{"jitter NaN", "redis_ratelimit {\n rate 1 1s\n jitter NaN\n}", []string{"jitter:", "fraction", "Testfile:3"}},
		{"dry_run arg", "redis_ratelimit {\n rate 1 1s\n dry_run yes\n}", []string{"dry_run:", "Testfile:3"}},
		{"fail_closed arg", "redis_ratelimit {\n rate 1 1s\n fail_closed 1\n}", []string{"fail_closed:", "Testfile:3"}},
		{"prefix braces", "redis_ratelimit {\n rate 1 1s\n prefix a{b}\n}", []string{"prefix:", "Testfile:3"}},
		{"prefix no arg", "redis_ratelimit {\n rate 1 1s\n prefix\n}", []string{"prefix:", "Testfile:3"}},
		{"key unknown namespace", "redis_ratelimit {\n rate 1 1s\n key {user}\n}", []string{"key:", "{user}", "Testfile:3"}},
		{"key two args", "redis_ratelimit {\n rate 1 1s\n key a b\n}", []string{"key:", "Testfile:3"}},
		{"two redis addresses", "redis_ratelimit {\n rate 1 1s\n redis 10.0.0.1:6379 10.0.0.2:6379\n}", []string{"redis:", "exactly one", "Testfile:3"}},
		{"two redis lines", "redis_ratelimit {\n rate 1 1s\n redis 10.0.0.1:6379\n redis 10.0.0.2:6379\n}", []string{"redis:", "exactly one", "Testfile:4"}},
		{"bad redis address", "redis_ratelimit {\n rate 1 1s\n redis localhost\n}", []string{"redis:", "invalid redis address", "Testfile:3"}},
		{"bad redis url", "redis_ratelimit {\n rate 1 1s\n redis http://10.0.0.1:6379\n}", []string{"redis:", "scheme", "Testfile:3"}},
		{"redis and cluster", "redis_ratelimit {\n rate 1 1s\n redis 10.0.0.1:6379\n cluster 10.0.0.2:7000\n}", []string{"cluster:", "mutually exclusive", "Testfile:4"}},
		{"cluster and sentinel", "redis_ratelimit {\n rate 1 1s\n cluster 10.0.0.2:7000\n sentinel mymaster 10.0.0.3:26379\n}", []string{"sentinel:", "mutually exclusive", "Testfile:4"}},
		{"bad timeout", "redis_ratelimit {\n rate 1 1s\n timeout -1s\n}", []string{"timeout:", "Testfile:3"}},
		{"bad db", "redis_ratelimit {\n rate 1 1s\n db x\n}", []string{"db:", "Testfile:3"}},
		{"rate bad literal window with placeholder n", "redis_ratelimit {\n rate {plan_rpm} soon\n}", []string{"rate:", "invalid duration", "Testfile:2"}},
		{"rate bad literal n with placeholder window", "redis_ratelimit {\n rate 0 {http.vars.w}\n}", []string{"rate:", ">= 1", "Testfile:2"}},
		{"cost zero", "redis_ratelimit {\n rate 1 1s\n cost 0\n}", []string{"cost:", "Testfile:3"}},
		{"cost not a number", "redis_ratelimit {\n rate 1 1s\n cost lots\n}", []string{"cost:", `"lots"`, "Testfile:3"}},
		{"cost fraction", "redis_ratelimit {\n rate 1 1s\n cost 1.5\n}", []string{"cost:", "Testfile:3"}},
		{"cost no arg", "redis_ratelimit {\n rate 1 1s\n cost\n}", []string{"cost:", "Testfile:3"}},
		{"count no arg", "redis_ratelimit {\n rate 1 1s\n count\n}", []string{"count:", "Testfile:3"}},
		{"count status low", "redis_ratelimit {\n rate 1 1s\n count 401 99\n}", []string{"count:", "100-599", `"99"`, "Testfile:3"}},
		{"count status high", "redis_ratelimit {\n rate 1 1s\n count 600\n}", []string{"count:", "100-599", "Testfile:3"}},
		{"count bad class", "redis_ratelimit {\n rate 1 1s\n count 6xx\n}", []string{"count:", "Testfile:3"}},
		{"count word", "redis_ratelimit {\n rate 1 1s\n count failures\n}", []string{"count:", "Testfile:3"}},
		{"wait bad", "redis_ratelimit {\n rate 1 1s\n wait forever\n}", []string{"wait:", "invalid duration", "Testfile:3"}},
		{"wait negative", "redis_ratelimit {\n rate 1 1s\n wait -1s\n}", []string{"wait:", "negative", "Testfile:3"}},
		{"wait two args", "redis_ratelimit {\n rate 1 1s\n wait 1s 2s\n}", []string{"wait:", "Testfile:3"}},
		{"ban bad", "redis_ratelimit {\n rate 1 1s\n ban forever\n}", []string{"ban:", "invalid duration", "Testfile:3"}},
		{"ban zero", "redis_ratelimit {\n rate 1 1s\n ban 0s\n}", []string{"ban:", "Testfile:3"}},
		{"ban below 1ms", "redis_ratelimit {\n rate 1 1s\n ban 10us\n}", []string{"ban:", "1ms", "Testfile:3"}},
		{"ban no arg", "redis_ratelimit {\n rate 1 1s\n ban\n}", []string{"ban:", "Testfile:3"}},
		{"ban twice", "redis_ratelimit {\n rate 1 1s\n ban 1m\n ban 2m\n}", []string{"ban", "Testfile:4"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h RedisRateLimit
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil {
				t.Fatal("no error")
			}
			msg := err.Error()
			if !strings.Contains(msg, "redis_ratelimit") {
				t.Errorf("error %q does not name the directive", msg)
			}
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q lacks %q", msg, w)
				}
			}
		})
	}
}

// TestRateLimitCaddyfileAdaptErrors: `caddy adapt` fails naming the
// directive, subdirective and line.
func TestRateLimitCaddyfileAdaptErrors(t *testing.T) {
	t.Parallel()
	adapter := caddyconfig.GetAdapter("caddyfile")
	in := "example.com {\n\tredis_ratelimit /api/* {\n\t\trate 10 1m\n\t\trate 5\n\t}\n\trespond ok\n}\n"
	_, _, err := adapter.Adapt([]byte(in), map[string]any{"filename": "Caddyfile"})
	if err == nil || !strings.Contains(err.Error(), "redis_ratelimit: rate:") || !strings.Contains(err.Error(), "Caddyfile:4") {
		t.Fatalf("want an error naming redis_ratelimit: rate: at Caddyfile:4, got %v", err)
	}
}

// TestRateLimitCostNormalised: a literal cost that strconv reads but JSON
// does not ("007", "+5") is adapted to a plain JSON number, and the config
// validates; before, the raw text made the handler's JSON invalid, so the
// adapter silently dropped the handler.
func TestRateLimitCostNormalised(t *testing.T) {
	t.Parallel()
	adapter := caddyconfig.GetAdapter("caddyfile")
	for _, c := range []struct{ cost, want string }{
		{"007", "7"}, {"+5", "5"}, {"12", "12"}, {"{http.request.header.Cost}", `"{http.request.header.Cost}"`},
	} {
		in := "{\n\tadmin off\n}\n:0 {\n\tredis_ratelimit {\n\t\trate 100 1m\n\t\tcost " + c.cost + "\n\t}\n\trespond ok\n}\n"
		out, warnings, err := adapter.Adapt([]byte(in), map[string]any{"filename": "Caddyfile"})
		if err != nil || len(warnings) > 0 {
			t.Fatalf("cost %s: adapt: %v %v", c.cost, err, warnings)
		}
		if !json.Valid(out) || !strings.Contains(string(out), `"cost":`+c.want+`,`) && !strings.Contains(string(out), `"cost":`+c.want+`}`) {
			t.Errorf("cost %s: adapted to %s, want \"cost\":%s", c.cost, out, c.want)
		}
		if !strings.Contains(string(out), `"handler":"redis_ratelimit"`) {
			t.Errorf("cost %s: the handler is missing from %s", c.cost, out)
		}
		testkit.WholeCaddy.Lock() // Validate provisions a whole config: one at a time
		err = caddy.Validate(mustConfig(t, out))
		testkit.WholeCaddy.Unlock()
		if err != nil {
			t.Errorf("cost %s: the adapted config does not validate: %v", c.cost, err)
		}
	}

	// A JSON config that gives the cost as such a string is written back
	// as a plain number too.
	h := new(RedisRateLimit)
	if err := json.Unmarshal([]byte(`{"cost":"007","rates":[{"requests":1,"window":"1s"}]}`), h); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(h)
	if err != nil || !json.Valid(b) || !strings.Contains(string(b), `"cost":7`) {
		t.Errorf("cost \"007\" from JSON marshals to %s (%v), want \"cost\":7", b, err)
	}
}

// mustConfig decodes an adapted config.
func mustConfig(t *testing.T, b []byte) *caddy.Config {
	t.Helper()
	cfg := new(caddy.Config)
	if err := json.Unmarshal(b, cfg); err != nil {
		t.Fatalf("decoding %s: %v", b, err)
	}
	return cfg
}

package redisdlm

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestWholeCaddyNeverShowsPassword runs Caddy at debug level with both
// handlers, passwords in redis:// URLs and in the password subdirective,
// over succeeding and failing runs (Redis up, down, wrong password, a
// Redlock member down, a failed Provision, a failed adapt), and greps every
// log line of this plugin, every error Caddy logs or returns, and every
// answer for the passwords.
func TestWholeCaddyNeverShowsPassword(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	const (
		pwURL   = "pw-in-url-5e1d"
		pwSub   = "pw-in-subdirective-77aa"
		pwDead  = "pw-of-dead-server-3c9b"
		pwWrong = "pw-wrong-0f42"
		pwProv  = "pw-failed-provision-a8d0"
		pwAdapt = "pw-failed-adapt-91bc"
	)
	secrets := []string{pwURL, pwSub, pwDead, pwWrong, pwProv, pwAdapt}
	r1 := startRedis(t, "--requirepass", pwURL)
	r2 := startRedis(t, "--requirepass", pwSub)
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	port := freePort(t)
	routes := []struct{ path, handler string }{
		{"/lock-url", "redis_lock {\n\t\t\tredis redis://:" + pwURL + "@" + r1.Addr + "\n\t\t}"},
		{"/lock-sub", "redis_lock {\n\t\t\tredis " + r2.Addr + "\n\t\t\tpassword " + pwSub + "\n\t\t}"},
		{"/rl-url", "redis_ratelimit {\n\t\t\tredis redis://:" + pwURL + "@" + r1.Addr + "\n\t\t\trate 100 1m\n\t\t}"},
		{"/rl-sub", "redis_ratelimit {\n\t\t\tredis " + r2.Addr + "\n\t\t\tpassword " + pwSub + "\n\t\t\trate 100 1m\n\t\t}"},
		{"/redlock", "redis_lock {\n\t\t\tredis redis://:" + pwURL + "@" + r1.Addr + " redis://:" + pwDead + "@" + dead + " redis://:" + pwSub + "@" + r2.Addr + "\n\t\t}"},
		{"/lock-dead", "redis_lock {\n\t\t\tredis redis://:" + pwDead + "@" + dead + "\n\t\t}"},
		{"/lock-dead-sub", "redis_lock {\n\t\t\tredis " + dead + "\n\t\t\tpassword " + pwDead + "\n\t\t}"},
		{"/rl-dead", "redis_ratelimit {\n\t\t\tredis redis://:" + pwDead + "@" + dead + "\n\t\t\trate 100 1m\n\t\t\tfail_closed\n\t\t}"},
		{"/rl-dead-sub", "redis_ratelimit {\n\t\t\tredis " + dead + "\n\t\t\tpassword " + pwDead + "\n\t\t\trate 100 1m\n\t\t}"},
		{"/lock-wrong", "redis_lock {\n\t\t\tredis redis://:" + pwWrong + "@" + r1.Addr + "\n\t\t}"},
		{"/rl-wrong", "redis_ratelimit {\n\t\t\tredis " + r2.Addr + "\n\t\t\tpassword " + pwWrong + "\n\t\t\trate 100 1m\n\t\t\tfail_closed\n\t\t}"},
	}
	want := map[string]int{"/lock-url": 200, "/lock-sub": 200, "/rl-url": 200, "/rl-sub": 200, "/redlock": 200,
		"/lock-dead": 503, "/lock-dead-sub": 503, "/rl-dead": 503, "/rl-dead-sub": 200, "/lock-wrong": 503, "/rl-wrong": 503}
	var sb strings.Builder
	fmt.Fprintf(&sb, "{\n\tadmin off\n\tauto_https off\n\tlog {\n\t\toutput file %s\n\t\tformat json\n\t\tlevel DEBUG\n\t}\n}\n:%d {\n", logFile, port)
	for _, r := range routes {
		fmt.Fprintf(&sb, "\thandle %s {\n\t\t%s\n\t\trespond ok\n\t}\n", r.path, r.handler)
	}
	sb.WriteString("}\n")
	testkit.RunCaddy(t, sb.String())

	var answers []string
	for round := 0; round < 3; round++ {
		for _, r := range routes {
			resp, body := get(t, fmt.Sprintf("http://127.0.0.1:%d%s", port, r.path))
			if resp == nil {
				t.FailNow()
			}
			if resp.StatusCode != want[r.path] {
				t.Errorf("%s: status %d, want %d", r.path, resp.StatusCode, want[r.path])
			}
			answers = append(answers, fmt.Sprint(resp.Header)+body)
		}
	}

	// A Provision that fails (the CA file is missing) after the URL
	// with a password was resolved: caddy validate and /load show this error.
	var errs []string
	for _, h := range []string{"redis_lock {\n\t\tredis rediss://:%s@%s\n\t\ttls %s\n\t}", "redis_ratelimit {\n\t\tredis rediss://:%s@%s\n\t\ttls %s\n\t\trate 1 1s\n\t}"} {
		h = fmt.Sprintf(h, pwProv, r1.Addr, filepath.Join(t.TempDir(), "missing-ca.pem"))
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(fmt.Sprintf("{\n\tadmin off\n}\n:%d {\n\t%s\n}\n", freePort(t), h)), nil)
		if err != nil {
			t.Fatalf("adapt: %v", err)
		}
		if err := caddy.Load(cfg, false); err == nil {
			t.Errorf("a config with a missing CA file loaded: %s", cfg)
		} else {
			errs = append(errs, err.Error())
		}
	}
	// An adapt that fails on a bad URL with a password in it.
	for _, bad := range []string{"redis://:" + pwAdapt + "@h:99999", "redis//:" + pwAdapt + "@h:1", "redis://:" + pwAdapt + "@h:1x"} {
		for _, dir := range []string{"redis_lock", "redis_ratelimit"} {
			src := fmt.Sprintf(":%d {\n\t%s {\n\t\tredis %s\n\t\trate 1 1s\n\t}\n}\n", port, dir, bad)
			if dir == "redis_lock" {
				src = fmt.Sprintf(":%d {\n\t%s {\n\t\tredis %s\n\t}\n}\n", port, dir, bad)
			}
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), nil)
			if err == nil {
				t.Errorf("%s with %q adapted", dir, bad)
				continue
			}
			errs = append(errs, err.Error())
		}
	}
	if len(errs) != 8 {
		t.Errorf("collected %d errors, want 8: %q", len(errs), errs)
	}

	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	var ours int
	for _, line := range strings.Split(string(b), "\n") {
		// Caddy logs its own config only as "config is unchanged" style
		// lines, never with module fields; every line counts.
		if strings.Contains(line, "redis") {
			ours++
		}
		for _, s := range secrets {
			if strings.Contains(line, s) {
				t.Errorf("log line shows a password: %s", line)
			}
		}
	}
	if ours < 5 {
		t.Errorf("only %d log lines about redis; the test saw no failures logged:\n%s", ours, b)
	}
	for _, e := range append(errs, answers...) {
		for _, s := range secrets {
			if strings.Contains(e, s) {
				t.Errorf("error or answer shows a password: %s", e)
			}
		}
	}
}

// A derived handler label (in /metrics, logs and stacked RateLimit-Policy
// entries) says nothing about the Redis password: configs that differ
// only in it, or in a URL's password, get the same label.
func TestHandlerLabelKeepsSecretsOut(t *testing.T) {
	lock := func(pw, addr string) string {
		h := &redislock.RedisLock{Keys: []string{"{http.request.uri.path}"}}
		h.Password = pw
		h.Addresses = []string{addr}
		return shared.HandlerLabel("lock", "", h)
	}
	if a, b := lock("secret-1", "127.0.0.1:6379"), lock("secret-2", "127.0.0.1:6379"); a != b {
		t.Errorf("password field changes the label: %s vs %s", a, b)
	}
	if a, b := lock("", "redis://u:secret-1@127.0.0.1:6379/0"), lock("", "redis://u:secret-2@127.0.0.1:6379/0"); a != b {
		t.Errorf("URL password changes the label: %s vs %s", a, b)
	}
	if a, b := lock("", "127.0.0.1:6379"), lock("", "127.0.0.1:6380"); a == b {
		t.Errorf("another server, the same label %s", a)
	}
}

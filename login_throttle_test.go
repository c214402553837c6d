package redisdlm

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"golang.org/x/crypto/bcrypt"
)

// TestWholeCaddyLoginThrottling: behind
// basic_auth, failed logins are limited only when the limiter runs first.
// In the default order basic_auth answers every wrong password itself
// (401) and the limiter never sees it: six failures, six 401s. With
// `order redis_ratelimit before basic_auth` and `count 401`, as the README
// shows, the third attempt within the window gets 429 — also with the right
// password — and a successful login before it counts nothing.
func TestWholeCaddyLoginThrottling(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	// The lowest bcrypt cost: each wrong password costs a compare, and the
	// default cost takes seconds under the race detector.
	hash, err := bcrypt.GenerateFromPassword([]byte("right"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	login := func(url, password string) int {
		req, _ := http.NewRequest("GET", url, nil)
		req.SetBasicAuth("alice", password)
		resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		name, global string
		want         []int // answers to: right, wrong ×5, right
	}{
		{"default order", "", []int{200, 401, 401, 401, 401, 401, 200}},
		{"limiter before basic_auth", "\torder redis_ratelimit before basic_auth\n", []int{200, 401, 401, 429, 429, 429, 429}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port, admin := freePort(t), freePort(t)
			testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
%s}
:%d {
	redis_ratelimit /admin/* {
		rate 2 1m
		count 401
		prefix login-%d:
		redis %s
	}
	basic_auth /admin/* {
		alice %s
	}
	respond "welcome"
}
`, admin, tc.global, port, port, r.Addr, hash))
			url := fmt.Sprintf("http://127.0.0.1:%d/admin/panel", port)
			var got []int
			for _, pw := range []string{"right", "wrong", "wrong", "wrong", "wrong", "wrong", "right"} {
				got = append(got, login(url, pw))
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("answers %v, want %v", got, tc.want)
			}
		})
	}
}

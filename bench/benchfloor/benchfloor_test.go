package benchfloor

import (
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// The directives read an address and an optional "batched", and refuse
// anything else.
func TestUnmarshalCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		in      string
		addr    string
		batched bool
		ok      bool
	}{
		{"bench_floor_lock 127.0.0.1:6379", "127.0.0.1:6379", false, true},
		{"bench_floor_lock batched 127.0.0.1:6379", "127.0.0.1:6379", true, true},
		{"bench_floor_lock", "", false, false},
		{"bench_floor_lock batched", "", false, false},
		{"bench_floor_lock a b", "", false, false},
		{"bench_floor_lock a {\n\tx\n}", "", false, false},
	} {
		var l Lock
		err := l.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if (err == nil) != tc.ok || (tc.ok && (l.Redis != tc.addr || l.Batched != tc.batched)) {
			t.Errorf("%q: %+v, %v", tc.in, l, err)
		}
		var rl RateLimit
		err = rl.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if (err == nil) != tc.ok || (tc.ok && (rl.Redis != tc.addr || rl.Batched != tc.batched)) {
			t.Errorf("%q (rate limit): %+v, %v", tc.in, rl, err)
		}
	}
}

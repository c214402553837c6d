package redisconn

import (
	"strings"
	"testing"
)

// secretPW is a password no error or log line may show.
const secretPW = "hunter2x"

// TestRedactURL: every rendering of a server hides the password, valid URL
// or not.
func TestRedactURL(t *testing.T) {
	t.Parallel()
	for _, s := range []string{
		"redis://:" + secretPW + "@h:1", "rediss://u:" + secretPW + "@h:1/2", "redis//:" + secretPW + "@h:1",
		"redis://u:" + secretPW + "@h:1x", secretPW + "@h:1", "redis://:" + secretPW + "@[::1]:1",
	} {
		for _, mode := range []string{"single", "cluster", "sentinel"} {
			d := Settings{Mode: mode, Addrs: []string{s, "127.0.0.1:1"}, Master: "m", Password: secretPW}.Display()
			if strings.Contains(d, secretPW) || !strings.Contains(d, "127.0.0.1:1") {
				t.Errorf("display of %q (%s) = %q", s, mode, d)
			}
		}
	}
	if got := RedactURL("rediss://alice:" + secretPW + "@h:1/2"); got != "rediss://alice:xxxxx@h:1/2" {
		t.Errorf("RedactURL kept too little or too much: %q", got)
	}
	// A password with a "/" whose start url.Parse reads as host and port.
	for _, slashed := range []string{
		"redis://:8123/Zk9" + secretPW + "@redis.internal:6379", // the start read as host and port
		"redis://u:p@a/b7" + secretPW + "@redis.internal:6379",  // an "@" in it too: the end read as the path
	} {
		if got := RedactURL(slashed); strings.Contains(got, secretPW) || !strings.Contains(got, "@redis.internal:6379") {
			t.Errorf("RedactURL(%q) = %q", slashed, got)
		}
		if err := ValidateAddress(slashed); err != nil && strings.Contains(err.Error(), secretPW) {
			t.Errorf("the config error of %q: %v, want one that does not show the password", slashed, err)
		}
	}
}

// TestServerID: the entries of a Redlock list that name one Redis server,
// whatever their spelling, and those that do not.
func TestServerID(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{"127.0.0.1:6379", "127.0.0.1:6379", true},
		{"127.0.0.1:6379", "redis://127.0.0.1:6379/0", true},
		{"127.0.0.1:6379", "redis://127.0.0.1", true},
		{"127.0.0.1:6379", "redis://127.0.0.1:6379/1", true}, // another db, the same server
		{"127.0.0.1:6379", "rediss://u:" + secretPW + "@127.0.0.1:6379/2", true},
		{"Redis-1.Internal:6379", "redis-1.internal.:6379", true},
		{"127.0.0.1:06379", "127.0.0.1:6379", true},
		{"[::1]:6379", "[0:0:0:0:0:0:0:1]:6379", true},
		{"[::1]:6379", "redis://[::1]", true},
		{"127.0.0.1:6379", "127.0.0.1:6380", false},
		{"127.0.0.1:6379", "127.0.0.2:6379", false},
		{"localhost:6379", "127.0.0.1:6379", false}, // names are not resolved
		{"{env.A}", "{env.A}", false},               // checked once replaced
	} {
		_, j := SameServer([]string{c.a, c.b})
		if got := j >= 0; got != c.same {
			t.Errorf("%q and %q: same server %v, want %v", c.a, c.b, got, c.same)
		}
	}
}

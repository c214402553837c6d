package redisdlm

import (
	"strings"
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/shared"
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

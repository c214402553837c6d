package lock

import (
	"strings"
	"testing"
)

// TestOnlyPlainReleaseRunsOverMaxmemory: a plain release may run on a
// server over maxmemory (it only deletes), the release that stores an
// answer for replay may not (the answer can be replay_max large); the
// redis_lock handler's TestReplayNotStoredOverMaxmemory sees it on a full
// Redis.
func TestOnlyPlainReleaseRunsOverMaxmemory(t *testing.T) {
	if !strings.HasPrefix(releaseScript.Source(), "#!lua flags=allow-oom\n") {
		t.Error("the plain release script does not carry allow-oom")
	}
	if strings.Contains(releaseStoreScript.Source(), "allow-oom") || releaseStoreScript.Hash() == releaseScript.Hash() {
		t.Error("the storing release script still carries allow-oom")
	}
}

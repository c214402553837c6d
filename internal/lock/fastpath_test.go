package lock

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// The uncontended paths of the acquire and release scripts (a key with no
// lease, wait list, dead token or delay entry) must leave Redis exactly as
// the full path does.

// acquireFor calls the acquire script as ask does (one key, permits 1, no
// replay, instances taking turns), for instance id self.
func acquireFor(t *testing.T, r *testredis.Server, key, token, self string) []int64 {
	t.Helper()
	res, err := acquireScript.Run(context.Background(), r.Client(), []string{key, FenceKey(key), WaitqKey(key), ReplayKey(key), DeadKey(key), DelayKey(key)},
		token, int64(30000), 1, self, int64(10000), 1, "0", "1", int64(0)).Int64Slice()
	if err != nil {
		t.Fatalf("acquire %s: %v", key, err)
	}
	return res
}

func releaseFor(t *testing.T, r *testredis.Server, key, token, self string) int64 {
	t.Helper()
	n, err := releaseScript.Run(context.Background(), r.Client(), []string{key, FenceKey(key), ReplayKey(key), WaitqKey(key), DeadKey(key), DelayKey(key)},
		token, WakeChannel, "msg", int64(0), int64(30000), "", int64(0), self, int64(0), "0", int64(0)).Int64()
	if err != nil {
		t.Fatalf("release %s: %v", key, err)
	}
	return n
}

// keyState is what a test compares of a key after a call: the lease's
// holders and remaining life, the fencing counter's life, and which
// companion keys exist.
type keyState struct {
	holders          int64
	leaseMs, fenceMs int64 // PTTL of the lock and of the counter
	waitq, dead      int64 // EXISTS
	scoreLeft        int64 // the lease's end minus now, ms
}

func stateOf(t *testing.T, r *testredis.Server, key string) keyState {
	t.Helper()
	ctx := context.Background()
	c := r.Client()
	st := keyState{holders: c.ZCard(ctx, key).Val(), leaseMs: c.PTTL(ctx, key).Val().Milliseconds(),
		fenceMs: c.PTTL(ctx, FenceKey(key)).Val().Milliseconds(),
		waitq:   c.Exists(ctx, WaitqKey(key)).Val(), dead: c.Exists(ctx, DeadKey(key)).Val()}
	if zs := c.ZRangeWithScores(ctx, key, 0, 0).Val(); len(zs) == 1 {
		now, _ := c.Time(ctx).Result()
		st.scoreLeft = int64(zs[0].Score) - now.UnixMilli()
	}
	return st
}

// near: the same within 2 s (the reads of two keys come at different
// moments, on a loaded machine; a wrong expiry is off by a ttl or has none).
func near(a, b int64) bool { return math.Abs(float64(a-b)) <= 2000 }

// TestUncontendedPathsAgree: a fresh key takes the uncontended paths; a
// key whose wait list holds only this instance's own stale entry takes the
// full ones, which come to the same grant (the entry goes) and the same
// release. Both leave the same lease, counter and companions, and the
// tokens are fencing tokens (never below Redis TIME in µs).
func TestUncontendedPathsAgree(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	ctx := context.Background()
	fresh, full := "caddy:lock:{fresh}", "caddy:lock:{full}"
	r.Client().ZAdd(ctx, WaitqKey(full), redisZ(time.Now().Add(time.Hour), "me"))

	before, _ := r.Client().Time(ctx).Result()
	a, b := acquireFor(t, r, fresh, "t1", "me"), acquireFor(t, r, full, "t2", "me")
	if a[0] != 1 || b[0] != 1 {
		t.Fatalf("grants %v and %v, want both granted", a, b)
	}
	floor := before.UnixMicro()
	if a[1] < floor || b[1] < floor {
		t.Fatalf("fencing tokens %d and %d, want at least Redis TIME %d µs", a[1], b[1], floor)
	}
	sa, sb := stateOf(t, r, fresh), stateOf(t, r, full)
	if sa.holders != 1 || sb.holders != 1 || !near(sa.leaseMs, sb.leaseMs) || !near(sa.fenceMs, sb.fenceMs) ||
		!near(sa.scoreLeft, sb.scoreLeft) || sa.waitq != 0 || sb.waitq != 0 || sa.dead != 0 || sb.dead != 0 {
		t.Fatalf("after the grant: uncontended path %+v, full path %+v; want the same", sa, sb)
	}
	if !near(sa.leaseMs, 30000) || !near(sa.fenceMs, 60000) {
		t.Fatalf("uncontended grant: lease PTTL %d ms, counter PTTL %d ms; want 30000 and 60000", sa.leaseMs, sa.fenceMs)
	}
	// A second acquire of the held key (another token) is refused by the
	// full path, as before.
	if c := acquireFor(t, r, fresh, "t3", "other"); c[0] != 0 {
		t.Fatalf("a second token on a held key: %v, want busy", c)
	}

	// Release: the fresh key now has a wait list (the refused "other"):
	// full path; a key without one takes the uncontended path.
	lone := "caddy:lock:{lone}"
	acquireFor(t, r, lone, "t4", "me")
	if releaseFor(t, r, lone, "wrong", "me") != 0 {
		t.Fatal("the uncontended release removed another token's lease")
	}
	if releaseFor(t, r, lone, "t4", "me") != 1 || releaseFor(t, r, fresh, "t1", "me") != 1 {
		t.Fatal("an owner's release did not remove its lease")
	}
	if n := r.Client().Exists(ctx, lone, fresh).Val(); n != 0 {
		t.Fatalf("%d lock keys left after the releases", n)
	}
}

// TestUncontendedCommands: an uncontended acquire and release run 6 and 2
// commands inside their scripts (they ran 14 and 7 before the uncontended
// paths): EXISTS, TIME, ZADD, PEXPIREAT, GET and SET for the grant with its
// fencing counter; EXISTS and the owner-checked ZREM for the release.
func TestUncontendedCommands(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	key := "caddy:lock:{count}"
	if err := r.Client().ConfigResetStat(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	acquireFor(t, r, key, "t1", "me")
	releaseFor(t, r, key, "t1", "me")
	var inside int64
	counted := ""
	for _, c := range []string{"exists", "time", "zadd", "pexpireat", "get", "set", "zrem", "zscore", "zremrangebyscore", "zcard", "zrange", "pexpire", "publish"} {
		if n := r.CommandCalls(c); n > 0 {
			inside += n
			counted += " " + c + "=" + strconv.FormatInt(n, 10)
		}
	}
	if inside != 8 {
		t.Fatalf("an uncontended acquire and release ran %d commands (%s), want 8", inside, counted)
	}
}

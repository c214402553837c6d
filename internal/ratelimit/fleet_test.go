package ratelimit

import (
	"testing"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestFleetBeat: the heartbeats of the instances sharing a prefix. An
// instance's first beat adds it to the set (Added), and while another
// instance has not beaten since the moment given as joining it is Behind;
// a beat of the other clears that. A heartbeat older than HeartbeatLife is
// no longer counted, and the set expires with its latest heartbeat's life.
// Another prefix is another fleet.
func TestFleetBeat(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := r.Client()
	ctx := t.Context()
	a, b := NewFleet(c, "p:", "a"), NewFleet(c, "p:", "b")
	defer a.Close()
	defer b.Close()
	beat := func(f *Fleet, joining int64) Beat {
		t.Helper()
		got, err := f.Beat(ctx, joining)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := beat(a, 0); got.Instances != 1 || !got.Added || got.Behind != 0 || got.At <= 0 {
		t.Fatalf("A's first beat: %+v, want 1 instance, added, none behind", got)
	}
	first := beat(b, 0)
	if first.Instances != 2 || !first.Added || first.Behind != 1 {
		t.Fatalf("B's first beat: %+v, want 2 instances, added, A behind (it has not counted B)", first)
	}
	if got := beat(b, first.At); got.Added || got.Behind != 1 {
		t.Fatalf("B again before A beat: %+v, want not added, A still behind", got)
	}
	beat(a, 0)
	if got := beat(b, first.At); got.Instances != 2 || got.Behind != 0 {
		t.Fatalf("B after A beat: %+v, want 2 instances, none behind", got)
	}
	if ttl := c.PTTL(ctx, FleetKey("p:")).Val(); ttl <= 0 || ttl > HeartbeatLife {
		t.Fatalf("the heartbeat set expires in %s, want within a heartbeat's life", ttl)
	}
	// An instance whose last beat is older than a heartbeat's life.
	old := first.At - 2*HeartbeatLife.Microseconds()
	if err := c.ZAdd(ctx, FleetKey("p:"), redis.Z{Score: float64(old), Member: "gone"}).Err(); err != nil {
		t.Fatal(err)
	}
	if got := beat(a, 0); got.Instances != 2 {
		t.Fatalf("a beat with a stale heartbeat in the set: %+v, want the 2 live instances", got)
	}
	if got := beat(NewFleet(c, "q:", "a"), 0); got.Instances != 1 || !got.Added {
		t.Fatalf("another prefix: %+v, want a fleet of its own", got)
	}
}

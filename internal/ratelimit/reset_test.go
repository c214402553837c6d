package ratelimit

import (
	"slices"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// TestLimitReset: Reset deletes an id's rate states (the rates given, and
// the rendered ones its rate index lists), its ban and its index, and tells
// every instance to forget the id; another id keeps its state. PeekBan sees
// the ban until then.
func TestLimitReset(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	c := r.Client()
	ctx := t.Context()
	b := NewBatcher(c, Options{Workers: Workers})
	t.Cleanup(b.Close)
	sub := c.Subscribe(ctx, ForgetChannel)
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil { // the subscription's confirmation
		t.Fatal(err)
	}
	lim := NewLimit("rs:", GCRA, LimitOptions{Ban: time.Minute, Indexed: true})
	fixed := Rate{N: 1, Window: time.Minute}
	rendered := Rate{N: 5, Window: time.Hour}
	p := lim.Plan([]Rate{fixed, rendered}, 1)
	decide := func(id string) Decision {
		t.Helper()
		call := lim.DecisionCall(id, p)
		if err := b.Do(ctx, call, 5*time.Second, nil); err != nil {
			t.Fatal(err)
		}
		d, err := call.Decision()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, id := range []string{"mallory", "mallory", "alice"} {
		decide(id) // mallory's second is rejected by the fixed rate and starts her ban
	}
	if _, left, err := lim.PeekBan(ctx, c, "mallory"); err != nil || left <= 0 || left > time.Minute {
		t.Fatalf("mallory's ban: %s left, %v; want under a minute", left, err)
	}
	res, err := lim.Reset(ctx, c, "mallory", []Rate{fixed})
	if err != nil || res.PublishErr != nil || !res.Complete {
		t.Fatalf("Reset: %+v, %v", res, err)
	}
	// The fixed rate's state, the rendered one found in the index, the ban
	// (listed), and the index (deleted too).
	if len(res.Keys) != 3 || res.Deleted != 4 || !slices.Contains(res.Keys, lim.BanKey("mallory")) {
		t.Fatalf("Reset listed %v and deleted %d, want the 2 states and the ban listed, and the index deleted too", res.Keys, res.Deleted)
	}
	if n := c.Exists(ctx, append(res.Keys, "rs:{mallory}:rates")...).Val(); n != 0 {
		t.Fatalf("%d of mallory's keys left after the reset", n)
	}
	msg, err := sub.ReceiveMessage(ctx)
	if err != nil || msg.Payload != "rs:\x00mallory" {
		t.Fatalf("the reset told the instances %v (%v), want the prefix and the id", msg, err)
	}
	if d := decide("mallory"); !d.Allowed {
		t.Fatalf("mallory after the reset: %+v, want admitted", d)
	}
	if q, err := lim.Peek(ctx, c, "alice", []Rate{fixed}); err != nil || !q.States[0].Held || q.States[0].Used != 1 {
		t.Fatalf("alice after mallory's reset: %+v, %v; want her admission kept", q, err)
	}
	if res, err := lim.Reset(ctx, c, "nobody", []Rate{fixed}); err != nil || res.Deleted != 0 {
		t.Fatalf("Reset of an id with no state: %+v, %v; want nothing deleted", res, err)
	}
}

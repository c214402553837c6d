package ratelimit

import (
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

// TestRateLimitPeekMatchesScript: the admin API's read of a quota gives the
// remaining quota and reset the rate-limit script itself reported for the
// last admission, for both algorithms, and changes nothing.
func TestRateLimitPeekMatchesScript(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	b := NewBatcher(r.Client(), Options{Workers: Workers})
	t.Cleanup(b.Close)
	for _, algo := range Algorithms() {
		t.Run(algo.Name(), func(t *testing.T) {
			rates := []Rate{{N: 4, Window: 20 * time.Second}}
			lim := NewLimit("peek:"+algo.Name()+":", algo, LimitOptions{})
			p := lim.Plan(rates, 1)
			ctx := t.Context()
			if q, err := lim.Peek(ctx, r.Client(), "u", rates); err != nil || q.States[0].Held {
				t.Fatalf("before any request: %+v, %v", q, err)
			}
			for i := 1; i <= 5; i++ {
				c := lim.DecisionCall("u", p)
				if err := b.Do(ctx, c, 5*time.Second, nil); err != nil { // a loaded machine
					t.Fatal(err)
				}
				d, err := c.Decision()
				if err != nil {
					t.Fatal(err)
				}
				if d.Allowed != (i <= 4) {
					t.Fatalf("request %d: allowed %v", i, d.Allowed)
				}
				for j := 0; j < 2; j++ { // a second read sees the same: reading counts nothing
					q, err := lim.Peek(ctx, r.Client(), "u", rates)
					if err != nil || len(q.States) != 1 || !q.States[0].Held {
						t.Fatalf("request %d: peek %+v %v", i, q, err)
					}
					s := q.States[0]
					if s.Remaining != d.Remaining || s.Used != 4-d.Remaining {
						t.Errorf("request %d: peek used %d remaining %d, the script said remaining %d", i, s.Used, s.Remaining, d.Remaining)
					}
					if diff := s.Reset.Truncate(time.Millisecond) - d.Reset; diff < -time.Second || diff > time.Second {
						t.Errorf("request %d: peek reset %s, the script said %s", i, s.Reset, d.Reset)
					}
				}
			}
		})
	}
}

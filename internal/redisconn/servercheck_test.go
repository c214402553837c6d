package redisconn

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
)

func TestVersionAtLeast(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{"7.0.15": true, "7.2.4": true, "8.0.0": true, "6.2.14": false, "6.9": false, "< 6.0": false, "": false, "x.y": false} {
		if got := versionAtLeast(v, [2]int{7, 0}); got != want {
			t.Errorf("versionAtLeast(%q, 7.0) = %v, want %v", v, got, want)
		}
	}
}

// A server restarted empty on its port is seen, with its new start, by the
// time the first answer of the new process comes back.
func TestCheckSeesRestart(t *testing.T) {
	r := testredis.Start(t)
	check := NewCheck(CheckOptions{Logger: func() *slog.Logger { return slog.New(slog.DiscardHandler) }})
	s := Settings{Mode: "single", Addrs: []string{r.Addr}, Timeout: 2 * time.Second}
	c, err := s.NewClient(check)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	started := check.Started()
	now, err := c.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if started == 0 || started > now.UnixMicro()+1_000_000 || started < now.UnixMicro()-20_000_000 {
		t.Fatalf("Started() = %d, Redis TIME %d: want a moment of the last seconds", started, now.UnixMicro())
	}
	if n := check.Restarts(); n != 0 {
		t.Fatalf("Restarts() = %d before any restart", n)
	}
	time.Sleep(1100 * time.Millisecond) // a start in another second
	r.Restart()
	// The first call after the restart fails (its connection is gone) or
	// goes on a new connection; by the answer of a call that reached the
	// new process, the restart is known.
	for i := 0; i < 5; i++ {
		if c.Ping(ctx).Err() == nil {
			break
		}
	}
	if n := check.Restarts(); n != 1 {
		t.Fatalf("Restarts() = %d after one restart, want 1", n)
	}
	if check.Started() <= started {
		t.Fatalf("Started() = %d after the restart, want later than %d", check.Started(), started)
	}
}

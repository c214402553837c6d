package redisconn

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

func connectedClients(t *testing.T, c *redis.Client) int {
	t.Helper()
	info, err := c.Info(context.Background(), "clients").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "connected_clients:"); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	t.Fatal("no connected_clients in INFO")
	return 0
}

// TestReaperSparesCallsInProgress: a call that waits on Redis for many
// times ConnMaxIdle (a blocking read, as a Pub/Sub connection's) keeps its
// connection; once the pool is idle, the reaper closes its connections
// on the server, and the next calls succeed: the pool drops the closed
// connections without sending on them and dials anew. Not parallel: it
// shortens ConnMaxIdle.
func TestReaperSparesCallsInProgress(t *testing.T) {
	defer func(d time.Duration) { ConnMaxIdle = d }(ConnMaxIdle)
	ConnMaxIdle = 100 * time.Millisecond
	r := testredis.Start(t)
	check := NewCheck(CheckOptions{Logger: func() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }})
	c, err := Settings{Mode: "single", Addrs: []string{r.Addr}, Timeout: 3 * time.Second}.NewClient(check)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// A read in progress for 10 × ConnMaxIdle.
	if err := c.BLPop(ctx, 10*ConnMaxIdle, "missing").Err(); err != redis.Nil {
		t.Fatalf("BLPOP of 1s with ConnMaxIdle %v: %v, want redis.Nil (the timeout's answer)", ConnMaxIdle, err)
	}
	rc := r.Client()
	if !waitFor(5*time.Second, func() bool { return connectedClients(t, rc) == 1 }) {
		t.Fatalf("%d connections 5s after the last call (the test's own included); want the client's closed after %v idle", connectedClients(t, rc), ConnMaxIdle)
	}
	for i := 0; i < 5; i++ {
		if err := c.Set(ctx, "k", i, 0).Err(); err != nil {
			t.Fatalf("call %d after the reaper closed the idle connections: %v", i, err)
		}
	}
}

func waitFor(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); ; time.Sleep(5 * time.Millisecond) {
		if cond() {
			return true
		} else if time.Now().After(deadline) {
			return false
		}
	}
}

package redisdlm

import (
	"context"
	"testing"
)

func TestRedisHelper(t *testing.T) {
	r := startRedis(t)
	if err := r.Client().Set(context.Background(), "a", "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	r.Restart()
	if n, _ := r.Client().Exists(context.Background(), "a").Result(); n != 0 {
		t.Fatalf("restart should come back empty, exists=%d", n)
	}
}

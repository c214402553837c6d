package redisconn

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestScriptCallsNeverResent: no script call, EVALSHA or EVAL, may be
// resent by go-redis: Run and Eval of any Script (the rate limiter's
// batcher: internal/ratelimit's TestBatcherCallsNeverResent).
func TestScriptCallsNeverResent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var sent []redis.Cmder
	capture := processorFunc(func(_ context.Context, c redis.Cmder) error {
		sent = append(sent, c)
		return nil
	})
	script := NewScript("return redis.call('GET', KEYS[1])")
	script.Run(ctx, capture, []string{"k"}, "token")
	script.Eval(ctx, capture, []string{"k"}, "token")
	if len(sent) != 2 {
		t.Fatalf("%d commands, want 2", len(sent))
	}
	for _, c := range sent {
		if !c.NoRetry() {
			t.Fatalf("%v may be resent by go-redis", c.Args()[:3])
		}
	}
}

type processorFunc func(context.Context, redis.Cmder) error

func (f processorFunc) Process(ctx context.Context, c redis.Cmder) error { return f(ctx, c) }

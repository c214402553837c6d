package main

// A floor for the client side of any batched limiter: each caller hands a
// decision to one worker over a channel and waits on a channel of its own;
// the worker sends what waits as one pipeline (a native GET and SET PX per
// decision, no script, no logic) and answers each caller. What this costs
// in Go CPU per decision is the hand-over and the pipeline, before any
// limiter's own work.

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

type floorCall struct {
	key  string
	done chan error
}

type floorBatcher struct {
	rc    *redis.Client
	queue chan *floorCall
}

func newFloorBatcher(rc *redis.Client) (*floorBatcher, func()) {
	b := &floorBatcher{rc: rc, queue: make(chan *floorCall, 1024)}
	stop := make(chan struct{})
	go func() {
		batch := make([]*floorCall, 0, 128)
		for {
			batch = batch[:0]
			select {
			case <-stop:
				return
			case c := <-b.queue:
				batch = append(batch, c)
			}
		fill:
			for len(batch) < cap(batch) {
				select {
				case c := <-b.queue:
					batch = append(batch, c)
				default:
					break fill
				}
			}
			ctx := context.Background()
			_, err := rc.Pipelined(ctx, func(p redis.Pipeliner) error {
				for _, c := range batch {
					p.Get(ctx, c.key)
					p.Set(ctx, c.key, "1764590400123456", time.Second)
				}
				return nil
			})
			if err == redis.Nil {
				err = nil
			}
			for _, c := range batch {
				c.done <- err
			}
		}
	}()
	return b, func() { close(stop) }
}

func (b *floorBatcher) decide(key string) error {
	c := &floorCall{key: key, done: make(chan error, 1)}
	b.queue <- c
	return <-c.done
}

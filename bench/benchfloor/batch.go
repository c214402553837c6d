package benchfloor

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// The batched floors: what concurrent requests hand over is sent as one
// pipeline by one worker (per handler), as redis_lock's pipe and
// redis_ratelimit's batcher send theirs. An idle worker sends at once;
// while a pipeline is out, new calls wait and leave together with the
// next one.

// exactFloor is the cost goals' exact floor: a GET and a SET … PX of each
// key, nothing else, one script call for a whole batch.
var exactFloor = redis.NewScript(`
for i = 1, #KEYS do
	redis.call('GET', KEYS[i])
	redis.call('SET', KEYS[i], '1764590400123456', 'PX', '1000')
end
return 1
`)

// call is one request's part of a batch: a command (the lock's), or a key
// (the rate limit's), and where its caller waits.
type call struct {
	cmd  redis.Cmder
	key  string
	err  error
	done chan struct{}
}

// batcher is a worker that sends what waits in its queue with send.
type batcher struct {
	queue chan *call
	stop  chan struct{}
}

// batchMax bounds one batch, as redis_lock's pipe and redis_ratelimit's
// batcher bound theirs.
const batchMax = 128

func newBatcher(send func(batch []*call) error) *batcher {
	b := &batcher{queue: make(chan *call, 1024), stop: make(chan struct{})}
	go func() {
		batch := make([]*call, 0, batchMax)
		for {
			batch = batch[:0]
			select {
			case <-b.stop:
				return
			case c := <-b.queue:
				batch = append(batch, c)
			}
		fill:
			for len(batch) < batchMax {
				select {
				case c := <-b.queue:
					batch = append(batch, c)
				default:
					break fill
				}
			}
			err := send(batch)
			for _, c := range batch {
				if c.err == nil {
					c.err = err
				}
				close(c.done)
			}
		}
	}()
	return b
}

// do hands c to the worker and waits for its answer.
func (b *batcher) do(c *call) error {
	c.done = make(chan struct{})
	b.queue <- c
	<-c.done
	return c.err
}

func (b *batcher) close() { close(b.stop) }

// pipelineSender sends each call's command in one pipeline.
func pipelineSender(rc *redis.Client) func([]*call) error {
	return func(batch []*call) error {
		p := rc.Pipeline()
		for _, c := range batch {
			_ = p.Process(context.Background(), c.cmd)
		}
		_, err := p.Exec(context.Background())
		if err == redis.Nil {
			err = nil
		}
		for _, c := range batch {
			if e := c.cmd.Err(); e != nil && e != redis.Nil {
				c.err = e
			}
		}
		return err
	}
}

// exactFloorSender decides a batch with one exact-floor script call.
func exactFloorSender(rc *redis.Client) func([]*call) error {
	return func(batch []*call) error {
		keys := make([]string, len(batch))
		for i, c := range batch {
			keys[i] = c.key
		}
		return exactFloor.Run(context.Background(), rc, keys).Err()
	}
}

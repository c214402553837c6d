package ratelimit

// The instances that share a prefix, through Redis: each with fail_local
// keeps a heartbeat in one sorted set per prefix (scripts/ratelimit_fleet.lua),
// and reads how many keep one (N, the local share's divisor).

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

var (
	//go:embed scripts/ratelimit_fleet.lua
	fleetLua    string
	fleetScript = redisconn.NewScript(fleetLua)
)

// fleetKey is the heartbeat set of prefix. The hash tag holds a character
// no limit id starts with, and the suffix is none of a rate's, so it never
// mixes with a limit's keys.
func fleetKey(prefix string) string { return prefix + "{~fleet}:instances" }

// Fleet keeps one instance's heartbeat among the instances sharing a
// prefix (NewFleet).
type Fleet struct {
	client redis.UniversalClient
	key    string
	member string
	// conn is the fleet's own connection (nil until the first beat, and
	// after a failure): a beat a second through the shared pool would take
	// each idle connection in turn (the pool hands out the oldest first)
	// and keep every one a burst opened from ever idling long enough for
	// the reaper.
	conn *redis.Conn
}

// beat records the heartbeat and reads the fleet (Fleet.Beat).
func (f *Fleet) beat(ctx context.Context, joining int64) (Beat, error) {
	var p redisconn.Processor = f.client
	if c := f.connection(ctx); c != nil {
		p = c
	}
	res, err := fleetScript.Run(ctx, p, []string{f.key}, f.member, HeartbeatLife.Microseconds(), joining).Int64Slice()
	if err == nil && len(res) != 4 {
		err = fmt.Errorf("unexpected answer of %d values", len(res))
	}
	if err != nil {
		f.close() // a broken connection is not used again
		return Beat{}, err
	}
	return Beat{At: res[0], Instances: res[1], Added: res[2] == 1, Behind: res[3]}, nil
}

// connection returns the fleet's own connection, taking one out of the
// pool (of the master of the heartbeat key's slot on a Cluster) when it has
// none; nil when none can be had (the beat then goes through the pool).
func (f *Fleet) connection(ctx context.Context) *redis.Conn {
	if f.conn != nil {
		return f.conn
	}
	switch c := f.client.(type) {
	case *redis.Client:
		f.conn = c.Conn()
	case *redis.ClusterClient:
		if m, err := c.MasterForKey(ctx, f.key); err == nil {
			f.conn = m.Conn()
		}
	}
	return f.conn
}

// close closes the fleet's own connection, if any.
func (f *Fleet) close() {
	if f.conn != nil {
		_ = f.conn.Close()
		f.conn = nil
	}
}

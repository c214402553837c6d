package ratelimit

// What an operator sees of a limit id and may do to it (the admin API): its
// quota per rate read without counting a request (scripts/ratelimit_peek.lua),
// its ban, and a reset of both that reaches every instance.

import (
	"context"
	_ "embed"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

var (
	//go:embed scripts/ratelimit_peek.lua
	peekLua    string
	peekScript = redisconn.NewScript(peekLua)
)

// maxIndexed bounds the rendered rate states of one id read from its
// rate index.
const maxIndexed = 1000

// states lists the rate states of id: one per rate of rates, in their
// order, and for an indexed limit every rendered rate the id's rate index
// lists (sorted by key; a missing or stale index lists nothing, or states
// that are gone). complete is false when the index lists more than
// maxIndexed.
func (l *Limit) states(ctx context.Context, c Admin, id string, rates []Rate) (states []RateState, complete bool, err error) {
	for _, r := range rates {
		r = l.algo.withDefaults(r)
		states = append(states, RateState{Key: l.keysOf(id) + l.algo.suffix(r), Rate: r})
	}
	if !l.o.Indexed {
		return states, true, nil
	}
	cmd := redis.NewStringSliceCmd(ctx, "zrange", l.indexKey(id), 0, maxIndexed)
	_ = c.Process(ctx, cmd)
	found, err := cmd.Result()
	if err != nil {
		return nil, false, err
	}
	complete = len(found) <= maxIndexed
	found = found[:min(len(found), maxIndexed)]
	slices.Sort(found)
	for _, k := range found {
		sfx, ok := strings.CutPrefix(k, l.keysOf(id))
		if !ok || slices.ContainsFunc(states, func(s RateState) bool { return s.Key == k }) {
			continue // not this id's, or a listed rate's state
		}
		r, ok := l.algo.parseSuffix(sfx)
		if !ok || l.algo.suffix(r) != sfx {
			continue // not as this limit writes it
		}
		states = append(states, RateState{Key: k, Rate: r, Indexed: true})
	}
	return states, complete, nil
}

// peek reads the quota of id (Limit.Peek).
func (l *Limit) peek(ctx context.Context, c Admin, id string, rates []Rate) (Quota, error) {
	states, complete, err := l.states(ctx, c, id, rates)
	if err != nil {
		return Quota{}, err
	}
	q := Quota{States: states, Complete: complete}
	if len(states) == 0 {
		return q, nil
	}
	keys := make([]string, len(states))
	for i, s := range states {
		keys[i] = s.Key
	}
	res, err := peekScript.Run(ctx, c, keys).Slice()
	if err != nil {
		return Quota{}, err
	}
	if len(res) != 2+len(keys) {
		return Quota{}, fmt.Errorf("unexpected peek answer of %d values", len(res))
	}
	sec, _ := res[0].(int64)
	usec, _ := res[1].(int64)
	now := float64(sec*1000000 + usec)
	for i := range q.States {
		s := &q.States[i]
		raw, _ := res[2+i].(string)
		var reset float64
		s.Held = raw != ""
		s.Used, s.Remaining, reset = l.algo.peek(raw, now, s.Rate)
		s.Reset = time.Duration(math.Ceil(reset)) * time.Microsecond
	}
	return q, nil
}

// peekBan reads id's ban (Limit.PeekBan).
func (l *Limit) peekBan(ctx context.Context, c Admin, id string) (until time.Time, left time.Duration, err error) {
	pipe := c.Pipeline()
	now := pipe.Time(ctx)
	ttl := pipe.PTTL(ctx, l.banKey(id))
	if _, err := pipe.Exec(ctx); err != nil {
		return time.Time{}, 0, err
	}
	if left = ttl.Val(); left <= 0 {
		return time.Time{}, 0, nil
	}
	return now.Val().Add(left), left, nil
}

// reset deletes id's quota and ban (Limit.Reset).
func (l *Limit) reset(ctx context.Context, c Admin, id string, rates []Rate) (ResetResult, error) {
	states, complete, err := l.states(ctx, c, id, rates)
	if err != nil {
		return ResetResult{}, err
	}
	res := ResetResult{Complete: complete}
	for _, s := range states {
		res.Keys = append(res.Keys, s.Key)
	}
	if l.o.Ban > 0 {
		res.Keys = append(res.Keys, l.banKey(id))
	}
	// A ban set by another limit with the same prefix goes too, and the
	// id's rate index.
	del := []any{"del"}
	for _, k := range res.Keys {
		del = append(del, k)
	}
	if l.o.Ban <= 0 {
		del = append(del, l.banKey(id))
	}
	if l.o.Indexed {
		del = append(del, l.indexKey(id))
	}
	cmd := redis.NewIntCmd(ctx, del...)
	_ = c.Process(ctx, cmd)
	if res.Deleted, err = cmd.Result(); err != nil {
		return res, err
	}
	res.PublishErr = publishForget(ctx, c, l.prefix, id)
	return res, nil
}

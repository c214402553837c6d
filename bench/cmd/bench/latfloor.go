package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The sequential latency row's floors, sampled in its rounds beside the
// PING (go-redis, one call each, every call on keys of its own): the
// one-command lock (exactly one round trip), and the
// round trip of the plugin's own acquire script on its uncontended path.
// What the script costs Redis and the wire beyond a PING is part of every
// locked request's wait, whatever the handler around it does.

// setNXFloor is `SET key token NX PX 8000` on a new key per call.
func setNXFloor(c *redis.Client, tag string) func(context.Context) error {
	n := 0
	return func(ctx context.Context) error {
		n++
		return c.SetNX(ctx, fmt.Sprintf("seqfloor-nx-%s-%d", tag, n), "0123456789abcdef0123456789abcdef0123", 8*time.Second).Err()
	}
}

// acquireFloor is an EVALSHA of the plugin's acquire script
// (internal/lock/scripts/lock_acquire.lua) on a new key per call, with
// the arguments of a request under `redis_lock` defaults (one permit, no
// replay, no lock_delay, instances taking turns): the script's uncontended
// path, as a locked request of the row takes it.
func acquireFloor(c *redis.Client, tag string) (func(context.Context) error, error) {
	src, err := os.ReadFile(filepath.Join(*scriptDir, "internal", "lock", "scripts", "lock_acquire.lua"))
	if err != nil {
		return nil, fmt.Errorf("the acquire script (see -scripts): %w", err)
	}
	script := redis.NewScript(string(src))
	if err := script.Load(context.Background(), c).Err(); err != nil {
		return nil, err
	}
	n := 0
	return func(ctx context.Context) error {
		n++
		k := fmt.Sprintf("seqfloor-acq-%s-%d", tag, n)
		keys := []string{k, k + ":fence", k + ":waitq", k + ":replay", k + ":dead", k + ":delay"}
		v, err := script.EvalSha(ctx, c, keys, "0123456789abcdef0123456789abcdef0123", 30000, 1, "bench-instance", 30000, 1, "0", "1", 0).Slice()
		if err == nil && (len(v) == 0 || v[0] != int64(1)) {
			err = fmt.Errorf("the acquire script did not grant a new key: %v", v)
		}
		return err
	}, nil
}

// acquireFloorNote puts the latency row beside its floors: SET NX PX and
// the acquire script alone, each ÷ the PING of the same rounds.
func acquireFloorNote(seq []seqResult) string {
	ping, nx, acq, plain, locked := seqNamed(seq, "ping"), seqNamed(seq, "set nx"), seqNamed(seq, "acquire script"), seqNamed(seq, "plain"), seqNamed(seq, "locked")
	var errs []string
	for _, s := range []seqResult{ping, nx, acq, plain, locked} {
		if s.err != nil {
			errs = append(errs, s.name+": "+s.err.Error())
		}
	}
	if len(errs) > 0 {
		return "✘ the latency row's floors: " + strings.Join(errs, "; ")
	}
	x := func(s seqResult) float64 { return float64(s.median) / float64(max(ping.median, 1)) }
	added := float64(locked.median-plain.median) / float64(max(ping.median, 1))
	return fmt.Sprintf("The latency row's floors, for scale (go-redis, sampled in the same rounds, each call after a `respond` request, new keys each call): `SET NX PX` alone p50 %s = **%.2f** PINGs (the one-command lock); the plugin's acquire script alone (EVALSHA, its uncontended path, the row's arguments) p50 %s = **%.2f** PINGs. Of the locked request's %.2f PINGs, %.2f are that script's round trip; the rest (%.2f) is HTTP through Caddy, the handler, and the release in the background.",
		ms(nx.median), x(nx), ms(acq.median), x(acq), added, x(acq), added-x(acq))
}

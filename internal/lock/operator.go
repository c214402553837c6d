package lock

// What an operator sees of a lock key and may do to it, on every server:
// its state (Inspect), a force release (ForceRelease) and the removal of
// its run record or stored answer (ClearReplay). Holder tokens never leave
// the engine: a token releases the lock.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// storedHeadMax is how much of a stored answer Inspect reads.
const storedHeadMax = 8 << 10

// forceReleaseFrom is the sender named in a force release's wake-up: no
// domain has this id, so every instance's waiters of the key are woken.
const forceReleaseFrom = "admin"

// inspect reads lockKey's state on every server, in server order.
func (l *Locker) inspect(ctx context.Context, lockKey string) []ServerState {
	keys := []string{lockKey, FenceKey(lockKey), WaitqKey(lockKey), ReplayKey(lockKey)}
	res := l.eachServer(ctx, func(ctx context.Context, s *Server) (any, error) {
		v, err := inspectScript.Run(ctx, s.client, keys, l.dom.id, storedHeadMax).Slice()
		if err != nil {
			return nil, err
		}
		return parseInspect(v)
	})
	out := make([]ServerState, len(res))
	for i, r := range res {
		if r.err != nil {
			out[i] = ServerState{Err: r.err}
			continue
		}
		out[i] = r.v.(ServerState)
	}
	return out
}

// parseInspect reads the inspect script's answer (lock_inspect.lua):
// {holders' lease left ms {..}, fence or "", waiting instances, this
// instance waiting 0|1, replay type, replay expiry ms, replay head or "",
// replay size, run record 0|1|2 (2: in doubt)}.
func parseInspect(v []any) (ServerState, error) {
	var st ServerState
	if len(v) != 9 {
		return st, fmt.Errorf("unexpected inspect answer of %d values", len(v))
	}
	left, _ := v[0].([]any)
	st.LeaseLeft = make([]time.Duration, 0, len(left))
	for _, x := range left {
		ms, _ := x.(int64)
		st.LeaseLeft = append(st.LeaseLeft, time.Duration(ms)*time.Millisecond)
	}
	if s, _ := v[1].(string); s != "" {
		if f, err := strconv.ParseInt(s, 10, 64); err == nil {
			st.Fence = &f
		}
	}
	n, _ := v[2].(int64)
	st.InstancesWaiting = int(n)
	me, _ := v[3].(int64)
	st.ThisInstanceWaiting = me == 1
	run, _ := v[8].(int64)
	if typ, _ := v[4].(string); typ != "none" && typ != "" {
		ttl, _ := v[5].(int64)
		head, _ := v[6].(string)
		size, _ := v[7].(int64)
		st.Stored = &Stored{Type: typ, TTL: time.Duration(ttl) * time.Millisecond, Size: size, Head: head, Run: run != 0}
	}
	st.InDoubt = run == 2
	return st, nil
}

// forceRelease removes every holder of lockKey on every server and wakes
// its waiters in every instance (this one's too). With lock_delay, each
// holder removed keeps its permit from everyone for the delay. The key's
// fencing counter stays, so an old holder's next extension finds its lease
// lost instead of re-creating it.
func (l *Locker) forceRelease(ctx context.Context, lockKey string) []Removal {
	keys := []string{lockKey, DelayKey(lockKey)}
	_, msg := wakeIDAndMessage(forceReleaseFrom, lockKey)
	delayMs := l.opts.LockDelay.Milliseconds()
	res := l.eachServer(ctx, func(ctx context.Context, s *Server) (any, error) {
		return forceReleaseScript.Run(ctx, s.client, keys, WakeChannel, msg, delayMs).Int64()
	})
	l.dom.wakeKeys([]string{lockKey})
	return removals(res)
}

// clearReplay deletes lockKey's run record or stored answer on every
// server.
func (l *Locker) clearReplay(ctx context.Context, lockKey string) []Removal {
	replay := ReplayKey(lockKey)
	res := l.eachServer(ctx, func(ctx context.Context, s *Server) (any, error) {
		cmd := redis.NewIntCmd(ctx, "del", replay)
		_ = s.client.Process(ctx, cmd)
		return cmd.Result()
	})
	return removals(res)
}

// eachServer runs f on every server in parallel, each call bounded by the
// locker's timeout, and waits for every answer (or ctx). A panic in f is
// that server's error, as in any fan-out of the engine.
func (l *Locker) eachServer(ctx context.Context, f func(ctx context.Context, s *Server) (any, error)) []result {
	res := l.callAll(ctx, func(ctx context.Context, _ int, s *Server) (any, error) {
		ctx, cancel := context.WithTimeout(ctx, l.opts.Timeout)
		defer cancel()
		return f(ctx, s)
	}, nil, nil)
	for i, r := range res {
		if !r.done {
			err := ctx.Err()
			if err == nil {
				err = errors.New("no answer")
			}
			res[i].err = fmt.Errorf("redis did not answer: %w", err)
		}
	}
	return res
}

// removals turns the counts of a fan-out into Removals.
func removals(res []result) []Removal {
	out := make([]Removal, len(res))
	for i, r := range res {
		out[i].Err = r.err
		if r.err == nil {
			out[i].Count, _ = r.v.(int64)
		}
	}
	return out
}

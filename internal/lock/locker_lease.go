package lock

// A Locker's calls for a held lease: the extension on every server and
// the renewal of a block of fencing tokens for local hand-offs.

import (
	"context"
	"fmt"
	"time"
)

// extend renews ls for another ttl on every server; it counts only with a
// majority, and only while the lease is valid: an extension that starts,
// or is answered, after the lease's validity ended is a lost lease in
// every mode (the lease may have lapsed and been taken by a rival
// meanwhile; it is never revived).
//
// The decision comes as soon as a majority answered; the calls to the
// other servers go on within the timeout, so a Redlock member that
// restarted empty gets the lease back in this round, not the next. Such a
// call may still be on its way when the lease is released, or its answer
// may be lost: both mark the lease's outcome unknown for its release (see
// lease.inflight).
func (l *Locker) extend(ctx context.Context, ls *Lease) error {
	start := l.now()
	prev := ls.validUntil()
	if !start.Before(prev) {
		return fmt.Errorf("%w: its validity ended %s before it could be extended (this process or redis was paused or slow)", ErrLeaseLost, start.Sub(prev).Round(time.Millisecond))
	}
	recreate := "0"
	if len(l.servers) > 1 {
		recreate = "1"
	}
	track := recreate == "1" && ls.inflight != nil && ls.unknown != nil
	for _, k := range ls.keys {
		if track {
			ls.inflight.Add(int32(len(l.servers)))
		}
		results := l.callAll(ctx, func(ctx context.Context, _ int, s *Server) (any, error) {
			if track {
				defer ls.inflight.Add(-1) // after unknown is stored
			}
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.Timeout)
			defer cancel()
			v, err := extendScript.Run(cctx, s.client, []string{k, FenceKey(k), DeadKey(k), DelayKey(k)}, ls.token, l.opts.TTL.Milliseconds(), l.opts.Permits, recreate, l.opts.LockDelay.Milliseconds()).Int64()
			if track && unknownOutcome(err) {
				ls.unknown.Store(true)
			}
			return v, err
		}, func(res []result, _ int) bool {
			ok, bad := 0, 0
			for _, r := range res {
				if r.done && r.err == nil && r.v.(int64) == 1 {
					ok++
				} else if r.done {
					bad++
				}
			}
			return ok >= l.quorum || bad > len(res)-l.quorum
		}, nil)
		ok, errs := 0, 0
		var lastErr error
		for _, r := range results {
			switch {
			case !r.done:
			case r.err != nil:
				errs++
				lastErr = r.err
			case r.v.(int64) == 1:
				ok++
			}
		}
		if ok < l.quorum {
			if errs > 0 && ok+errs >= l.quorum {
				// Not refused by a majority: Redis is unreachable; the lease
				// may still hold until it runs out.
				return fmt.Errorf("%w: extending: %v", ErrUnavailable, lastErr)
			}
			return ErrLeaseLost
		}
	}
	if now := l.now(); now.After(prev) {
		return fmt.Errorf("%w: the extension was answered %s after the lease's validity ended", ErrLeaseLost, now.Sub(prev).Round(time.Millisecond))
	}
	validity := l.validity(start)
	if validity <= 0 {
		return fmt.Errorf("%w: extension took longer than the lease", ErrLeaseLost)
	}
	ls.setUntil(start.Add(validity))
	return nil
}

// renewal is a lease renewal in flight: another block of fencing tokens
// for local hand-offs, granted only while no other instance waits.
type renewal struct {
	done  chan struct{}
	ok    bool
	fence int64 // the block's last token
	n     int
	until time.Time
	asked time.Time // when the block was asked for (its tokens' floor)
}

// renew asks Redis, in the background, to extend ls and reserve n tokens.
func (l *Locker) renew(ls *Lease, n int) *renewal {
	r := &renewal{done: make(chan struct{}), n: n}
	go func() {
		defer close(r.done)
		defer l.recoverPanic("renewing a lease")
		ctx, cancel := context.WithTimeout(context.Background(), l.opts.Timeout)
		defer cancel()
		start := l.now()
		k := ls.keys[0]
		v, err := renewScript.Run(ctx, l.servers[0].client, []string{k, FenceKey(k), WaitqKey(k), DelayKey(k)},
			ls.token, l.opts.TTL.Milliseconds(), l.dom.id, n, l.opts.LockDelay.Milliseconds()).Int64Slice()
		if err == nil && len(v) == 2 && v[0] == 1 {
			r.ok, r.fence, r.until, r.asked = true, v[1], start.Add(l.opts.TTL), start
		}
	}()
	return r
}

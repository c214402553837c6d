package lock

// The keeper: a held lease extended every ttl/3 while its request runs.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// keeper keeps one lease alive while its request runs. It is driven by a
// timer, not a goroutine of its own, so a request that ends before the
// first extension costs no goroutine start or join on the hand-off path.
type keeper struct {
	ls      *Lease
	extend  bool          // auto_extend
	maxHold time.Duration // stop extending after this long (0: never)
	onLost  func(error)

	mu      sync.Mutex
	t       *time.Timer
	stopped bool
	running bool
	cancel  context.CancelFunc
	done    chan struct{} // made by a stop that finds a fire running, closed by that fire
}

// newKeeper starts keeping ls: with o.Extend, it is extended every ttl/3
// (owner-checked) until stop or o.MaxHold; a lease that is not extended (any
// more) is reported lost when its validity ends. o.OnLost runs at most once.
func newKeeper(ls *Lease, o KeepOptions) *keeper {
	k := &ls.keeper // a lease's first keeper is in its own allocation
	if !ls.kept.CompareAndSwap(false, true) {
		k = new(keeper)
	}
	k.ls, k.extend, k.maxHold, k.onLost = ls, o.Extend, o.MaxHold, o.OnLost
	k.mu.Lock()
	k.t = time.AfterFunc(k.next(), k.fire)
	k.mu.Unlock()
	return k
}

// next is the delay to the next timer event.
func (k *keeper) next() time.Duration {
	if k.extendNow() {
		every := k.ls.l.opts.TTL / 3
		if v := k.ls.Valid() / 2; v < every {
			every = v // a handed-on lease may have less than a full ttl left
		}
		if every < time.Millisecond {
			every = time.Millisecond
		}
		return every
	}
	if v := k.ls.Valid(); v > 0 {
		return v
	}
	return 0
}

func (k *keeper) extendNow() bool {
	return k.extend && (k.maxHold <= 0 || k.ls.l.now().Sub(k.ls.start) < k.maxHold)
}

func (k *keeper) fire() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	k.running = true
	ctx, cancel := context.WithCancel(context.Background())
	k.cancel = cancel
	k.mu.Unlock()

	var lost error
	func() {
		defer k.ls.l.recoverPanic("keeping a lease alive")
		if !k.extendNow() {
			if k.ls.Valid() <= 0 {
				lost = fmt.Errorf("%w: the lease ran out before the request ended (ttl %s, max_hold %s)", ErrLeaseLost, k.ls.l.opts.TTL, k.maxHold)
			}
			return
		}
		err := k.ls.l.extend(ctx, k.ls)
		switch {
		case err == nil || ctx.Err() != nil:
		case errors.Is(err, ErrLeaseLost):
			lost = err
		case k.ls.Valid() <= 0:
			lost = fmt.Errorf("%w: %v", ErrLeaseLost, err)
		}
	}()
	cancel()

	k.mu.Lock()
	defer k.mu.Unlock()
	k.running = false
	if k.stopped {
		if k.done != nil {
			close(k.done)
		}
		return
	}
	if lost != nil {
		k.stopped = true
		k.ls.markLost()
		k.onLost(lost)
		return
	}
	d := k.next()
	if !k.extendNow() && d <= 0 {
		d = time.Millisecond
	} else if k.ls.Valid() < k.ls.l.opts.TTL/3 {
		// Redis did not answer: try again sooner while the lease may hold.
		if d > k.ls.Valid()/3 {
			d = k.ls.Valid() / 3
		}
		if d < 10*time.Millisecond {
			d = 10 * time.Millisecond
		}
	}
	k.t.Reset(d)
}

// stop ends the keeping and waits for an extension in flight to be
// decided. With Redlock, its calls to a minority may still be on their way
// after that: the release that comes next marks the token dead then, so
// none of them can re-create the lease (see lease.inflight).
func (k *keeper) stop() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	k.stopped = true
	k.t.Stop()
	var done chan struct{}
	if k.running {
		done = make(chan struct{})
		k.done = done
		if k.cancel != nil {
			k.cancel()
		}
	}
	k.mu.Unlock()
	if done != nil {
		<-done
	}
}

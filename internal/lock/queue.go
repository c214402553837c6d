package lock

// Local queues: the waiters of one key set in this Caddy instance, first
// come first served.

import (
	"sync"
)

// keyQueue is the FIFO of this instance's waiters for one key set. Only
// the head asks Redis; the others wait for their turn.
type keyQueue struct {
	id       string
	keys     []string
	wakeIDs  []string // WakeID of each key
	wakeMsgs []string // the wake-up a release of each key announces: "<domain id> <WakeID>"
	refs     int      // guarded by domain.mu

	mu      sync.Mutex
	waiters []*waiter
	first   [1]*waiter // the waiters' first backing array
	// Of a queue of one key: its wake ID and wake message (wakeIDs and
	// wakeMsgs point here), and, when it was the key's first queue, the
	// domain's byWake entry for the key (guarded by domain.mu): an
	// uncontended request's queue is one allocation.
	one  [2]string
	self [1]*keyQueue
	held int       // leases of this key set held in this instance
	hint busyFacts // last known facts of the holder
	// releasing of the held leases are being released in Redis (in the
	// background, after the answer); releaseEnd, made when a waiter asks
	// (releaseDone), is closed as the next of those ends.
	releasing  int
	releaseEnd chan struct{}
}

// waiter is one request waiting in a keyQueue.
type waiter struct {
	q     *keyQueue
	turn  chan struct{} // closed when this waiter becomes head
	wake  chan struct{} // buffered: a release happened
	grant chan *Lease   // buffered: a lease handed on by the previous holder
}

func (w *waiter) head() bool {
	select {
	case <-w.turn:
		return true
	default:
		return false
	}
}

// headTurn is the turn of a waiter that heads its queue when it arrives
// (most do): closed already, and shared. A waiter that arrives behind
// others gets a turn of its own, closed when it becomes head.
var headTurn = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// waiters are reused (recycle): a waiter and its two channels are four
// allocations, which every locked request would make otherwise.
var waiters = sync.Pool{New: func() any {
	return &waiter{wake: make(chan struct{}, 1), grant: make(chan *Lease, 1)}
}}

// enqueue appends a waiter; false when maxWaiters (>0) are already waiting.
func (q *keyQueue) enqueue(maxWaiters int) (*waiter, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if maxWaiters > 0 && len(q.waiters) >= maxWaiters {
		return nil, false
	}
	w := waiters.Get().(*waiter)
	w.q = q
	if len(q.waiters) == 0 {
		w.turn = headTurn // its turn now: nobody closes it again
	} else {
		w.turn = make(chan struct{})
	}
	q.waiters = append(q.waiters, w)
	return w, true
}

// leave removes w; if it was the head, the next waiter's turn begins. It
// returns a lease handed to w that w has not taken yet.
func (q *keyQueue) leave(w *waiter) *Lease {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, x := range q.waiters {
		if x == w {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			if i == 0 && len(q.waiters) > 0 {
				close(q.waiters[0].turn)
			}
			break
		}
	}
	select {
	case g := <-w.grant:
		return g
	default:
		return nil
	}
}

// recycle puts w back for another request, once it left its queue (leave):
// nothing sends to it any more (a grant or a wake-up is only sent, under
// the queue's lock, to a waiter in the queue), and leave took its grant.
func (w *waiter) recycle() {
	select {
	case <-w.wake:
	default:
	}
	w.q, w.turn = nil, nil
	waiters.Put(w)
}

// waiting counts the waiters queued here.
func (q *keyQueue) waiting() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters)
}

// position counts the waiters queued before w.
func (q *keyQueue) position(w *waiter) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, x := range q.waiters {
		if x == w {
			return i
		}
	}
	return len(q.waiters)
}

func (q *keyQueue) empty() bool { return q.waiting() == 0 }

func (q *keyQueue) acquired() {
	q.mu.Lock()
	q.held++
	q.mu.Unlock()
}

// releaseStarted records a lease of this key set whose release in Redis
// began (it is not handed on any more).
func (q *keyQueue) releaseStarted() {
	q.mu.Lock()
	q.releasing++
	q.mu.Unlock()
}

// released records that a lease releaseStarted announced is given back.
func (q *keyQueue) released() {
	q.mu.Lock()
	if q.held > 0 {
		q.held--
	}
	if q.releasing > 0 {
		q.releasing--
		if q.releaseEnd != nil {
			close(q.releaseEnd)
			q.releaseEnd = nil
		}
	}
	q.mu.Unlock()
}

// releaseDone returns a channel closed when the next background release of
// this key set ends, or nil when none runs. It is made here, when a waiter
// asks (an uncontended release costs none).
func (q *keyQueue) releaseDone() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.releasing > 0 && q.releaseEnd == nil {
		q.releaseEnd = make(chan struct{})
	}
	return q.releaseEnd
}

// heldLocally reports whether this instance holds every permit, not
// counting leases whose release already began (they are not handed on).
func (q *keyQueue) heldLocally(permits int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.held-q.releasing >= permits
}

func (q *keyQueue) wakeHead() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) > 0 {
		select {
		case q.waiters[0].wake <- struct{}{}:
		default:
		}
	}
}

func (q *keyQueue) setRetryHint(f busyFacts) {
	q.mu.Lock()
	q.hint = f
	q.mu.Unlock()
}

// retryHint is the last known facts of the holder, as of now (lease left 0
// when unknown or past).
func (q *keyQueue) retryHint() busyFacts {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.hint.aged()
}

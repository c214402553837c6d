package lock

// Local queues: the waiters of one key set in this Caddy instance, first
// come first served, and the domains that share them across handlers and
// config reloads.

import (
	"strings"
	"sync"

	"github.com/google/uuid"
)

// domain groups the local queues of lockers that share the same Redis
// servers and lease options, across handlers and config reloads, so the
// waiters of one key in one Caddy instance form one queue.
type domain struct {
	key  string
	id   string // this instance's id in Redis wait lists and wake messages
	refs int    // guarded by domainsMu

	mu     sync.Mutex
	queues map[string]*keyQueue              // by joined key set
	byWake map[string]map[*keyQueue]struct{} // by the WakeID of each key
}

var (
	domainsMu sync.Mutex
	domains   = map[string]*domain{}
)

func acquireDomain(key string) *domain {
	domainsMu.Lock()
	defer domainsMu.Unlock()
	d := domains[key]
	if d == nil {
		d = &domain{key: key, id: uuid.NewString(), queues: map[string]*keyQueue{}, byWake: map[string]map[*keyQueue]struct{}{}}
		domains[key] = d
	}
	d.refs++
	return d
}

func releaseDomain(d *domain) {
	domainsMu.Lock()
	defer domainsMu.Unlock()
	d.refs--
	if d.refs == 0 {
		delete(domains, d.key)
	}
}

// otherDomains lists every domain of this process but the one with id.
func otherDomains(id string) []*domain {
	domainsMu.Lock()
	defer domainsMu.Unlock()
	ds := make([]*domain, 0, len(domains))
	for _, d := range domains {
		if d.id != id {
			ds = append(ds, d)
		}
	}
	return ds
}

// queue returns the queue of a key set, creating it; pair with putQueue.
func (d *domain) queue(keys []string) *keyQueue {
	id := strings.Join(keys, "\x00")
	d.mu.Lock()
	defer d.mu.Unlock()
	q := d.queues[id]
	if q == nil {
		q = &keyQueue{id: id, keys: keys, wakeIDs: make([]string, len(keys))}
		d.queues[id] = q
		for i, k := range keys {
			w := WakeID(k)
			q.wakeIDs[i] = w
			m := d.byWake[w]
			if m == nil {
				m = map[*keyQueue]struct{}{}
				d.byWake[w] = m
			}
			m[q] = struct{}{}
		}
	}
	q.refs++
	return q
}

// putQueue drops a reference; an unused queue is forgotten.
func (d *domain) putQueue(q *keyQueue) {
	d.mu.Lock()
	defer d.mu.Unlock()
	q.refs--
	if q.refs == 0 {
		delete(d.queues, q.id)
		for _, w := range q.wakeIDs {
			delete(d.byWake[w], q)
			if len(d.byWake[w]) == 0 {
				delete(d.byWake, w)
			}
		}
	}
}

// othersWaiting reports whether another local queue that shares a key with
// q has waiters (a request for keys {a,b} while q is {a}).
func (d *domain) othersWaiting(q *keyQueue) bool {
	d.mu.Lock()
	var qs []*keyQueue
	for _, w := range q.wakeIDs {
		for o := range d.byWake[w] {
			if o != q {
				qs = append(qs, o)
			}
		}
	}
	d.mu.Unlock()
	for _, o := range qs {
		if o.waiting() > 0 {
			return true
		}
	}
	return false
}

// wakeKeys wakes the head waiter of every local queue that involves one of
// keys (a release here).
func (d *domain) wakeKeys(keys []string) {
	ids := make([]string, len(keys))
	for i, k := range keys {
		ids[i] = WakeID(k)
	}
	d.wake(ids)
}

// wake wakes the head waiter of every local queue that involves a key of
// one of the wake ids (a release here or, via Pub/Sub, elsewhere).
func (d *domain) wake(ids []string) {
	d.mu.Lock()
	var qs []*keyQueue
	for _, w := range ids {
		for q := range d.byWake[w] {
			qs = append(qs, q)
		}
	}
	d.mu.Unlock()
	for _, q := range qs {
		q.wakeHead()
	}
}

// wakeAll wakes the head waiter of every local queue.
func (d *domain) wakeAll() {
	d.mu.Lock()
	qs := make([]*keyQueue, 0, len(d.queues))
	for _, q := range d.queues {
		qs = append(qs, q)
	}
	d.mu.Unlock()
	for _, q := range qs {
		q.wakeHead()
	}
}

// keyQueue is the FIFO of this instance's waiters for one key set. Only
// the head asks Redis; the others wait for their turn.
type keyQueue struct {
	id      string
	keys    []string
	wakeIDs []string
	refs    int // guarded by domain.mu

	mu      sync.Mutex
	waiters []*waiter
	held    int       // leases of this key set held in this instance
	hint    busyFacts // last known facts of the holder
	// releasing of the held leases are being released in Redis (in the
	// background, after the answer); releaseEnd is closed (and replaced) as
	// each of those ends.
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

// enqueue appends a waiter; false when maxWaiters (>0) are already waiting.
func (q *keyQueue) enqueue(maxWaiters int) (*waiter, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if maxWaiters > 0 && len(q.waiters) >= maxWaiters {
		return nil, false
	}
	w := &waiter{q: q, turn: make(chan struct{}), wake: make(chan struct{}, 1), grant: make(chan *Lease, 1)}
	q.waiters = append(q.waiters, w)
	if len(q.waiters) == 1 {
		close(w.turn)
	}
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
	if q.releaseEnd == nil {
		q.releaseEnd = make(chan struct{})
	}
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
		close(q.releaseEnd)
		q.releaseEnd = nil
		if q.releasing > 0 {
			q.releaseEnd = make(chan struct{})
		}
	}
	q.mu.Unlock()
}

// releaseDone returns a channel closed when the next background release of
// this key set ends, or nil when none runs.
func (q *keyQueue) releaseDone() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
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

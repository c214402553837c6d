package lock

// Domains: the local queues of lockers that share the same Redis servers
// and lease options, across handlers and config reloads.

import (
	"slices"
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
	queues map[string]*keyQueue   // by joined key set
	byWake map[string][]*keyQueue // by the WakeID of each key (mostly one queue)
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
		d = &domain{key: key, id: uuid.NewString(), queues: map[string]*keyQueue{}, byWake: map[string][]*keyQueue{}}
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
		q = &keyQueue{id: id, keys: keys}
		if len(keys) == 1 {
			// Most queues: one key, named in the queue's own allocation.
			q.wakeIDs, q.wakeMsgs = q.one[:1:1], q.one[1:2:2]
		} else {
			wake := make([]string, 2*len(keys))
			q.wakeIDs, q.wakeMsgs = wake[:len(keys)], wake[len(keys):]
		}
		q.waiters = q.first[:0]
		d.queues[id] = q
		for i, k := range keys {
			w, msg := wakeIDAndMessage(d.id, k)
			q.wakeIDs[i], q.wakeMsgs[i] = w, msg
			if qs := d.byWake[w]; len(qs) == 0 && i == 0 {
				// The key's only queue: its entry lives in the queue
				// (a second queue of the key appends to a new array).
				q.self[0] = q
				d.byWake[w] = q.self[:1:1]
			} else {
				d.byWake[w] = append(qs, q)
			}
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
			qs := slices.DeleteFunc(d.byWake[w], func(o *keyQueue) bool { return o == q })
			if len(qs) == 0 {
				delete(d.byWake, w)
			} else {
				d.byWake[w] = qs
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
		for _, o := range d.byWake[w] {
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
		for _, q := range d.byWake[w] {
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

// local counts the domain's waiters and holders of a Redis lock key, over
// every local queue that involves it.
func (d *domain) local(redisKey string) (waiters, held int) {
	d.mu.Lock()
	qs := slices.Clone(d.byWake[WakeID(redisKey)])
	d.mu.Unlock()
	for _, q := range qs {
		q.mu.Lock()
		waiters += len(q.waiters)
		held += q.held
		q.mu.Unlock()
	}
	return waiters, held
}

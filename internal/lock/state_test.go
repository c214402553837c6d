package lock

// Read-outs of the engine's state for its own tests.

// queueCount is the number of local key queues of the locker's domain.
func (l *Locker) queueCount() int {
	l.dom.mu.Lock()
	defer l.dom.mu.Unlock()
	return len(l.dom.queues)
}

// waitersFor counts the local waiters queued for one Redis key alone (the
// queue of that one key, not of a key set holding it).
func (l *Locker) waitersFor(redisKey string) int {
	d := l.dom
	d.mu.Lock()
	q := d.queues[redisKey]
	d.mu.Unlock()
	if q == nil {
		return 0
	}
	return q.waiting()
}

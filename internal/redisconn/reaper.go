package redisconn

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// The idle reaper: go-redis v9 closes an idle connection only when a call
// takes it from the pool (and at most three per call), so after a burst or
// a slow Redis a quiet Caddy kept every connection the burst opened, up to
// PoolSize per server, for as long as no call came (the soak: a Redlock
// server at 186 connections after a quiet minute, 22 before the faults).
// The client's dialer therefore wraps each connection, and a sweep every
// reapEvery closes those no read or write used for ConnMaxIdle +
// reapEvery, whatever the traffic.
//
// It never closes a connection a call is using: a read or write in
// progress holds it off, and one that would start after the close fails
// before it sends a byte. It does not close one that a call has just
// taken either: the pool refuses, on taking it, a connection idle for
// ConnMaxIdle, so the reaper could only meet one it accepted if more than
// reapEvery passed between the pool's check and the call's first write
// (against a call bound of 500ms by default). The pool drops a closed
// connection when it next looks at it (the close already freed the
// server's side).

// reapEvery is how often a client's sweep looks at its connections: a
// connection is closed between ConnMaxIdle + reapEvery and ConnMaxIdle +
// 2 × reapEvery after its last use.
func reapEvery() time.Duration { return max(ConnMaxIdle/12, time.Millisecond) }

// reaper tracks the open connections of one client.
type reaper struct {
	idle  time.Duration // ConnMaxIdle when the client was made
	every time.Duration

	mu    sync.Mutex
	conns map[*reapConn]struct{}
	timer *time.Timer // the next sweep, while conns is not empty
}

func newReaper() *reaper {
	return &reaper{idle: ConnMaxIdle, every: reapEvery(), conns: map[*reapConn]struct{}{}}
}

// dialer wraps dial (go-redis's own, TLS included) so that every
// connection it makes is tracked.
func (r *reaper) dialer(dial func(context.Context, string, string) (net.Conn, error)) func(context.Context, string, string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		rc := &reapConn{Conn: c, r: r}
		r.mu.Lock()
		r.conns[rc] = struct{}{}
		if r.timer == nil {
			r.timer = time.AfterFunc(r.every, r.sweep)
		}
		r.mu.Unlock()
		if sc, ok := c.(syscall.Conn); ok {
			// The pool's health check peeks at the socket through it,
			// each time a call takes the connection: made once here.
			if raw, err := sc.SyscallConn(); err == nil {
				return &reapSysConn{rc, raw}, nil
			}
		}
		return rc, nil
	}
}

// sweep closes the connections idle long enough and runs again while any
// connection is open (no timer, no goroutine once the client is closed).
func (r *reaper) sweep() {
	limit := int((r.idle+r.every-1)/r.every) + 2 // sweeps in a row that found it unused
	var idle []*reapConn
	r.mu.Lock()
	for c := range r.conns {
		v := c.st.Load()
		if v != c.seen || v&inFlight != 0 {
			c.seen, c.quiet = v, 0
			continue
		}
		// Unchanged since the last sweep: no read or write began or
		// ended; the swap fails if one did meanwhile.
		if c.quiet++; c.quiet >= limit && c.st.CompareAndSwap(v, v|reaped) {
			delete(r.conns, c)
			idle = append(idle, c)
		}
	}
	if len(r.conns) > 0 {
		r.timer.Reset(r.every)
	} else {
		r.timer = nil
	}
	r.mu.Unlock()
	for _, c := range idle {
		_ = c.Conn.Close()
	}
}

func (r *reaper) forget(c *reapConn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
}

// A connection's state word: reads and writes in progress in the low 31
// bits, reaped in bit 31 (a read or write that begins then fails), the
// count of those ended in the high 32 bits (wrapping).
const (
	inFlight = 1<<31 - 1
	reaped   = 1 << 31
	ended    = 1<<32 - 1 // added by end: one more ended, one fewer in progress
)

// reapConn is a client connection the reaper watches.
type reapConn struct {
	net.Conn
	r     *reaper
	st    atomic.Uint64
	seen  uint64 // st at the last sweep (the reaper's)
	quiet int    // sweeps in a row that found it unused (the reaper's)
}

// begin counts a read or write, unless the reaper closed the connection.
func (c *reapConn) begin() bool { return c.st.Add(1)&reaped == 0 }

func (c *reapConn) end() { c.st.Add(ended) }

func (c *reapConn) Read(b []byte) (int, error) {
	if !c.begin() {
		return 0, net.ErrClosed
	}
	defer c.end()
	return c.Conn.Read(b)
}

func (c *reapConn) Write(b []byte) (int, error) {
	if !c.begin() {
		return 0, net.ErrClosed
	}
	defer c.end()
	return c.Conn.Write(b)
}

func (c *reapConn) Close() error {
	c.r.forget(c)
	return c.Conn.Close()
}

// reapSysConn is a reapConn over a plain TCP connection: go-redis's health
// check of an idle connection (a peek at the socket) still works through it.
type reapSysConn struct {
	*reapConn
	raw syscall.RawConn
}

func (c *reapSysConn) SyscallConn() (syscall.RawConn, error) { return c.raw, nil }

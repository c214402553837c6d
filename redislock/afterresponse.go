package redislock

import (
	"context"
	"net"
	"net/http"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// The release of an HTTP/1 request's lock waits until its response is on
// the wire: the client's answer never waits for the release's round trip,
// and is complete before (or while) the lease is released. Caddy's server
// says, through net/http's connection states, when a connection's response has
// been written (StateIdle, before the next request is read), or that the
// connection closed or was hijacked. Released from the handler instead, the
// release's goroutine and its Redis write compete with the response for
// the CPU: a sequential locked request answered about 0.25–0.5 Redis round
// trips later on two cores.
//
// Only what is sure waits, and never long: an HTTP/1 request without a
// body (net/http drains an unread body before it reports the connection
// idle, and a client may stall there) on a server whose hooks have been
// seen running. A release waits at most waitBound after the handler
// returned: past it, it is sent anyway (a client that stopped reading its
// answer, a connection whose end net/http never reports). HTTP/2 and
// HTTP/3, a request with a body, a connection hijacked while the route ran
// (a WebSocket), and a route provisioned after its server started are
// released as the handler returns, as before; so are execute-once (replay)
// and a client gone with lock_delay (handler.go's release).

// waitBound is the longest a release waits for its response to be written.
const waitBound = time.Second

// afterResponse is the process's table of releases that wait for their
// connection's response.
var afterResponse = &responseWaits{conns: map[net.Conn]*responseWait{}}

// responseWaits maps each connection to the locked requests on it whose
// response has not been written yet.
type responseWaits struct {
	mu       sync.Mutex
	conns    map[net.Conn]*responseWait // a chain per connection (nested locks)
	deferred []*responseWait            // the waits with a lease, oldest first (the sweeper's)
	sweeping bool                       // a sweeper runs
	pending  atomic.Int64               // entries in conns: the hooks' fast path when 0
	ran      atomic.Int64               // releases sent from a hook, after their response
	overdue  atomic.Int64               // releases sent by the sweeper, past waitBound
	servers  sync.Map                   // *caddyhttp.Server → *serverHook
}

// responseWait is one locked request waiting for its response, in storage
// of the request's own (no allocation of its own).
type responseWait struct {
	conn  net.Conn
	next  *responseWait // the connection's other waits
	done  bool          // answered: its connection was seen idle, closed or hijacked, or waitBound passed
	lease *lease        // released then (nil until the handler returned)
	since time.Time     // when the handler returned
}

// serverHook is the hooks of one Caddy server: live once net/http called
// them (the server was started with them); users counts the handlers
// provisioned on that server.
type serverHook struct {
	srv   *caddyhttp.Server
	live  atomic.Bool
	users atomic.Int64
	// A request finds its connection by r.RemoteAddr, which net/http sets
	// from it: byAddr holds the server's TCP connections by remote address,
	// addrOf each connection noted (its address, "" for one that is not
	// TCP), both guarded by mu. The connection the ConnContext hook put in
	// the request's context is the fallback (a Unix socket's connections
	// all have one address, "@"): that lookup walks every value Caddy and
	// net/http put on the request since, about a microsecond per locked
	// request.
	mu     sync.Mutex
	byAddr map[string]openConn
	addrOf map[net.Conn]string
}

// openConn is the open connection of one remote address; with more than
// one at a time (listeners on several local addresses), conn is nil until
// they all closed, and their requests find theirs in the context.
type openConn struct {
	conn net.Conn
	n    int
}

// connCtxKey holds the request's connection (set by the server's
// ConnContext hook).
type connCtxKey struct{}

// hookServer registers the connection hooks on the server that provisions
// a handler, once per server; it returns them (nil when there is no
// server), for begin and unhook. The server that provisions a handler is
// the one that serves it.
func (a *responseWaits) hookServer(ctx caddy.Context) *serverHook {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil {
		return nil
	}
	v, loaded := a.servers.LoadOrStore(srv, &serverHook{srv: srv, byAddr: map[string]openConn{}, addrOf: map[net.Conn]string{}})
	hook := v.(*serverHook)
	hook.users.Add(1)
	if loaded {
		return hook
	}
	srv.RegisterConnContext(func(ctx context.Context, c net.Conn) context.Context {
		// Nothing here may read from c, or wait on it: net/http runs this
		// hook in its accept loop (a PROXY protocol connection's
		// RemoteAddr waits for its header).
		if !keyable(c) {
			return ctx // its requests release as the handler returns
		}
		return context.WithValue(ctx, connCtxKey{}, c)
	})
	srv.RegisterConnState(func(c net.Conn, s http.ConnState) {
		if !hook.live.Load() {
			hook.live.Store(true)
		}
		if !keyable(c) {
			return
		}
		switch s {
		case http.StateActive:
			// On the connection's own goroutine, before its request's
			// handler runs: net/http has read its remote address already.
			hook.note(c)
		case http.StateIdle:
			if a.pending.Load() > 0 {
				a.written(c)
			}
		case http.StateClosed, http.StateHijacked:
			hook.forget(c)
			if a.pending.Load() > 0 {
				a.written(c)
			}
		}
	})
	return hook
}

// note adds c, a connection of the server that has become active, to
// byAddr (once: a connection is active once per request).
func (h *serverHook) note(c net.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, seen := h.addrOf[c]; seen {
		return
	}
	addr := ""
	if ra, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		addr = ra.String() // as net/http makes RemoteAddr
	}
	h.addrOf[c] = addr
	if addr == "" {
		return
	}
	o := h.byAddr[addr]
	if o.n++; o.n == 1 {
		o.conn = c
	} else {
		o.conn = nil // two at once: neither is known by its address
	}
	h.byAddr[addr] = o
}

// forget takes c, a connection that closed or was hijacked, out of
// byAddr.
func (h *serverHook) forget(c net.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	addr, seen := h.addrOf[c]
	if !seen {
		return
	}
	delete(h.addrOf, c)
	if o, ok := h.byAddr[addr]; ok && addr != "" {
		if o.n--; o.n <= 0 {
			delete(h.byAddr, addr)
		} else {
			h.byAddr[addr] = o // still nil: which one is left is not known
		}
	}
}

// find is the one open connection with remote address addr (nil for none,
// or when several share it).
func (h *serverHook) find(addr string) net.Conn {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.byAddr[addr].conn
}

// unhook undoes one hookServer (the handler is cleaned up): the server is
// forgotten with its last handler. Its hooks stay registered on it while it
// runs (they cannot be taken off) and go on answering the waits of its
// connections.
func (a *responseWaits) unhook(hook *serverHook) {
	if hook != nil && hook.users.Add(-1) <= 0 {
		a.servers.Delete(hook.srv)
	}
}

// keyable reports whether c can key the table: a pointer, as every
// connection net/http and Caddy's listeners make (a struct value could
// hold what cannot be hashed, and the map would panic).
func keyable(c net.Conn) bool {
	return c != nil && reflect.TypeOf(c).Kind() == reflect.Pointer
}

// begin notes in w a locked request, served by the server of hook, whose
// release may wait for its response; it reports false when it may not
// (then the handler releases as it returns).
func (a *responseWaits) begin(r *http.Request, hook *serverHook, w *responseWait) bool {
	if hook == nil || !hook.live.Load() || r.ProtoMajor != 1 || r.ContentLength != 0 { // a body: length unknown (-1) or known
		return false
	}
	conn := hook.find(r.RemoteAddr)
	if conn == nil {
		// Not known by its address (not a TCP connection, or it shares
		// the address with another, or a handler before this one changed
		// RemoteAddr): the connection the ConnContext hook put in the
		// context. (RemoteAddr changed to the address of another open
		// connection: the release waits for that one's response instead,
		// at most waitBound; later, never unsent.)
		if conn, _ = r.Context().Value(connCtxKey{}).(net.Conn); conn == nil {
			return false
		}
	}
	a.mu.Lock()
	w.conn, w.next = conn, a.conns[conn]
	a.conns[conn] = w
	a.pending.Add(1)
	a.mu.Unlock()
	return true
}

// release releases ls once w's response is on the wire: later, from the
// connection's hook (or the sweeper, past waitBound), or now if that moment
// passed already (the connection closed or was hijacked while the route
// ran).
func (a *responseWaits) release(w *responseWait, ls *lease) {
	a.mu.Lock()
	if !w.done {
		w.lease, w.since = ls, time.Now()
		a.deferred = append(a.deferred, w)
		if !a.sweeping {
			a.sweeping = true
			go a.sweep()
		}
		a.mu.Unlock()
		return
	}
	a.mu.Unlock()
	ls.ReleaseInBackground("")
}

// written sends the releases that waited on c: its response was written, or
// it closed or was hijacked.
func (a *responseWaits) written(c net.Conn) {
	a.mu.Lock()
	w := a.conns[c]
	if w == nil {
		a.mu.Unlock()
		return
	}
	delete(a.conns, c)
	var due []*lease
	n := int64(0)
	for ; w != nil; w = w.next {
		w.done, n = true, n+1
		if w.lease != nil {
			due = append(due, w.lease)
		}
	}
	a.pending.Add(-n)
	a.mu.Unlock()
	a.ran.Add(int64(len(due)))
	sendReleases(due)
}

// sweep sends, every waitBound/4 while releases wait, those that waited
// waitBound.
func (a *responseWaits) sweep() {
	t := time.NewTicker(waitBound / 4)
	defer t.Stop()
	for range t.C {
		now := time.Now()
		var due []*lease
		a.mu.Lock()
		keep := a.deferred[:0]
		for _, w := range a.deferred {
			switch {
			case w.done: // its hook answered it
			case now.Sub(w.since) >= waitBound:
				a.unlink(w)
				due = append(due, w.lease)
			default:
				keep = append(keep, w)
			}
		}
		clear(a.deferred[len(keep):]) // no reference kept to the answered
		a.deferred = keep
		idle := len(keep) == 0
		if idle {
			a.sweeping = false
		}
		a.mu.Unlock()
		a.overdue.Add(int64(len(due)))
		sendReleases(due)
		if idle {
			return
		}
	}
}

// unlink takes w, not answered yet, out of its connection's chain
// (a.mu held).
func (a *responseWaits) unlink(w *responseWait) {
	w.done = true
	a.pending.Add(-1)
	head := a.conns[w.conn]
	if head == w {
		if w.next == nil {
			delete(a.conns, w.conn)
		} else {
			a.conns[w.conn] = w.next
		}
		return
	}
	for p := head; p != nil; p = p.next {
		if p.next == w {
			p.next = w.next
			return
		}
	}
}

// sendReleases sends the releases; a panic in one is logged and does not keep the
// others from being sent (they run on a connection's goroutine, or the
// sweeper's, outside any handler).
func sendReleases(due []*lease) {
	for _, ls := range due {
		func() {
			defer func() {
				if r := recover(); r != nil {
					caddy.Log().Named("http.handlers.redis_lock").Error("panic releasing a lock after its response; recovered", zap.Any("panic", r))
				}
			}()
			ls.ReleaseInBackground("")
		}()
	}
}

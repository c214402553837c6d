package redisdlm

import (
	"context"
	"net"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The release of an HTTP/1 request's lock waits until its response is on
// the wire (SPEC §3 item 12: "before (or while)"). Caddy's server says,
// through net/http's connection states, when a connection's response has
// been written (StateIdle, before the next request is read), or that the
// connection closed or was hijacked. Released from the handler instead, the
// release's goroutine and its Redis write compete with the response for
// the CPU: a sequential locked request answered about 0.4 Redis round
// trips later on two cores (docs/benchmarks.md, eleventh round).
//
// Only what is sure waits: an HTTP/1 request on a server whose hook has
// been seen running. A route provisioned after its server started gets no
// hook, and HTTP/2 and HTTP/3 have no such state per request: those are
// released as the handler returns, as before. A connection hijacked while
// the route ran (a WebSocket through reverse_proxy) is released as the
// handler returns too.

// afterResponse is the process's table of releases that wait for their
// connection's response.
var afterResponse = &responseWaits{conns: map[net.Conn]*responseWait{}}

// responseWaits maps each connection to the locked requests on it whose
// response has not been written yet.
type responseWaits struct {
	mu      sync.Mutex
	conns   map[net.Conn]*responseWait // a chain per connection (nested locks)
	pending atomic.Int64               // entries in conns: the hooks' fast path when 0
	ran     atomic.Int64               // releases run from a hook, after their response
	servers sync.Map                   // *caddyhttp.Server → *serverHook
}

// responseWait is one locked request waiting for its response, in storage
// of the request's own (no allocation of its own).
type responseWait struct {
	next  *responseWait // the connection's other waits
	done  bool          // the connection was seen idle, closed or hijacked
	lease *lease        // released then (nil until the handler returned)
}

// serverHook is the hooks of one Caddy server: live once net/http called
// them (the server was started with them); users counts the handlers
// provisioned on that server.
type serverHook struct {
	live  atomic.Bool
	users atomic.Int64
}

// connCtxKey holds the request's connection (set by the server's
// ConnContext hook).
type connCtxKey struct{}

// hookServer registers the connection hooks on the server that provisions
// a handler, once per server; it returns that server (nil when there is
// none), for unhook.
func (a *responseWaits) hookServer(ctx caddy.Context) *caddyhttp.Server {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil {
		return nil
	}
	v, loaded := a.servers.LoadOrStore(srv, &serverHook{})
	hook := v.(*serverHook)
	hook.users.Add(1)
	if loaded {
		return srv
	}
	srv.RegisterConnContext(func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connCtxKey{}, c)
	})
	srv.RegisterConnState(func(c net.Conn, s http.ConnState) {
		if !hook.live.Load() {
			hook.live.Store(true)
		}
		switch s {
		case http.StateIdle, http.StateClosed, http.StateHijacked:
			if a.pending.Load() > 0 {
				a.written(c)
			}
		}
	})
	return srv
}

// unhook undoes one hookServer (the handler is cleaned up): the server is
// forgotten with its last handler. Its hooks stay registered on it while it
// runs (they cannot be taken off) and go on answering the waits of its
// connections.
func (a *responseWaits) unhook(srv *caddyhttp.Server) {
	if srv == nil {
		return
	}
	if v, ok := a.servers.Load(srv); ok && v.(*serverHook).users.Add(-1) <= 0 {
		a.servers.Delete(srv)
	}
}

// begin notes in w a locked request whose release may wait for its
// response; it reports false when it may not (then the handler releases as
// it returns).
func (a *responseWaits) begin(r *http.Request, w *responseWait) bool {
	if r.ProtoMajor != 1 {
		return false
	}
	ctx := r.Context()
	srv, _ := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	conn, _ := ctx.Value(connCtxKey{}).(net.Conn)
	if srv == nil || conn == nil {
		return false
	}
	if v, ok := a.servers.Load(srv); !ok || !v.(*serverHook).live.Load() {
		return false
	}
	a.mu.Lock()
	w.next = a.conns[conn]
	a.conns[conn] = w
	a.pending.Add(1)
	a.mu.Unlock()
	return true
}

// release releases ls once w's response is on the wire: later, from the
// connection's hook, or now if that moment passed already (the connection
// closed or was hijacked while the route ran).
func (a *responseWaits) release(w *responseWait, ls *lease) {
	a.mu.Lock()
	if !w.done {
		w.lease = ls
		a.mu.Unlock()
		return
	}
	a.mu.Unlock()
	ls.ReleaseInBackground("")
}

// written releases what waited on c: its response was written, or it closed
// or was hijacked.
func (a *responseWaits) written(c net.Conn) {
	a.mu.Lock()
	w := a.conns[c]
	if w == nil {
		a.mu.Unlock()
		return
	}
	delete(a.conns, c)
	var run *responseWait
	n := int64(0)
	for x := w; x != nil; {
		next := x.next
		x.done, n = true, n+1
		if x.lease != nil {
			x.next, run = run, x
		} else {
			x.next = nil
		}
		x = next
	}
	a.pending.Add(-n)
	a.mu.Unlock()
	for x := run; x != nil; x = x.next {
		a.ran.Add(1)
		x.lease.ReleaseInBackground("")
	}
}

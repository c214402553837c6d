// Package benchmutex is a Caddy HTTP handler for benchmarking only: the
// ceiling of the hot-key figure (a perfect in-process lock
// through Caddy). It is not part of the redisdlm plugin; `make bench` builds
// it into a second binary, bin/caddy-ceiling.
//
//	bench_mutex
//
// holds one process-wide sync.Mutex around the rest of the route (every
// site, every key, every config reload share it) and sets the request
// header Lock-Fencing-Token to a counter that increases with each holder,
// so the bench's upstream checks (one request inside, increasing tokens)
// apply to it as to redis_lock.
//
// Fairness: sync.Mutex, not a ticket queue. On the hot key every waiter
// waits far longer than 1 ms, which puts the mutex in starvation mode:
// Unlock hands it directly to the longest waiter (FIFO) and yields to it,
// and newcomers queue at the tail instead of barging. The holder does not
// re-ask at once either: its client has to read the response and send a new
// request first.
package benchmutex

import (
	"net/http"
	"strconv"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// FencingHeader is the header redis_lock sets by default.
const FencingHeader = "Lock-Fencing-Token"

var (
	mu    sync.Mutex // the one lock of the process
	fence int64      // guarded by mu
)

func init() {
	caddy.RegisterModule(Mutex{})
	httpcaddyfile.RegisterHandlerDirective("bench_mutex", parseCaddyfile)
	// Where redis_lock is: it wraps request_header, reverse_proxy, ...
	httpcaddyfile.RegisterDirectiveOrder("bench_mutex", httpcaddyfile.Before, "request_header")
}

// Mutex serialises every request through it, process-wide.
type Mutex struct{}

// CaddyModule returns the Caddy module information.
func (Mutex) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.bench_mutex",
		New: func() caddy.Module { return new(Mutex) },
	}
}

// ServeHTTP runs next while holding the process-wide mutex; the mutex is
// released when next returns, i.e. once reverse_proxy has copied the
// upstream's response to the client's writer, as redis_lock releases.
func (Mutex) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	mu.Lock()
	defer mu.Unlock()
	fence++
	r.Header.Set(FencingHeader, strconv.FormatInt(fence, 10))
	return next.ServeHTTP(w, r)
}

// UnmarshalCaddyfile accepts the bare directive: `bench_mutex`.
func (m *Mutex) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(0) {
		return d.Err("bench_mutex takes no block")
	}
	return nil
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(Mutex)
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return m, err
}

var (
	_ caddyhttp.MiddlewareHandler = (*Mutex)(nil)
	_ caddyfile.Unmarshaler       = (*Mutex)(nil)
)

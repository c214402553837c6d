package shared

// The registry the admin API (the redisadmin module) reads: every
// provisioned handler whose state an operator may look at, with the config
// load and HTTP server it belongs to. A handler module registers its
// handlers at the end of Provision and answers their requests
// (AdminHandler); the admin module only routes.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// AdminHandler is what a handler module gives the admin API of one
// provisioned handler.
type AdminHandler interface {
	// AdminKind is its directive: "redis_lock" or "redis_ratelimit".
	AdminKind() string
	// AdminName is its name ("" without one).
	AdminName() string
	// AdminView completes its entry in GET /redisdlm/ (prefix, key
	// templates, rates).
	AdminView(v *HandlerView)
	// ServeAdmin answers a request for one of its keys: sub is "" for the
	// key itself, else the path segment after it ("release", "replay");
	// e is the handler's entry (its servers' display names).
	ServeAdmin(w http.ResponseWriter, r *http.Request, e *AdminEntry, key, sub string) error
}

// AdminSegments maps the admin API's path segment of each kind to its
// directive: /redisdlm/locks/... and /redisdlm/limits/...
var AdminSegments = map[string]string{"locks": "redis_lock", "limits": "redis_ratelimit"}

// AdminEntry is one provisioned handler, as the admin API sees it.
type AdminEntry struct {
	cfg     <-chan struct{} // Done of the context of the config that loaded it
	Server  string          // the name of the HTTP server (srv0, ...) it runs in
	Handler AdminHandler
	Servers []string // display forms of its Redis, without user info
}

// ServerName is the display form of server i ("" when unknown).
func (e *AdminEntry) ServerName(i int) string {
	if i < len(e.Servers) {
		return e.Servers[i]
	}
	return ""
}

func (e *AdminEntry) kind() string { return e.Handler.AdminKind() }
func (e *AdminEntry) name() string { return e.Handler.AdminName() }

// adminRegistry holds every provisioned handler, in provision order; the
// admin API shows those of the running config.
var adminRegistry struct {
	mu      sync.Mutex
	entries []*AdminEntry
}

// RegisterAdmin records a provisioned handler (the last step of its
// Provision), whose connection settings are rc. A name must be unique
// among the handlers of one kind in one config.
func RegisterAdmin(ctx caddy.Context, h AdminHandler, rc *RedisConfig) error {
	// A handler's context is its config's root context with values added
	// (the HTTP server), so its Done channel is the root's: it identifies
	// the config load.
	e := &AdminEntry{cfg: ctx.Done(), Handler: h}
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		e.Server = srv.Name()
	}
	name := e.name()
	if name != "" {
		if err := CheckHandlerName(name); err != nil {
			return fmt.Errorf("%s: name: %w", e.kind(), err)
		}
	}
	settings, err := rc.Resolve()
	if err != nil {
		return fmt.Errorf("%s: %w", e.kind(), err)
	}
	for _, s := range settings {
		e.Servers = append(e.Servers, displayServer(s))
	}
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	if name != "" {
		for _, o := range adminRegistry.entries {
			if o.cfg == e.cfg && o.kind() == e.kind() && o.name() == name && (o.Server == e.Server || !sameConfig(o, e)) {
				return fmt.Errorf("%s: name: %q is already the name of another %s handler in this config", e.kind(), name, e.kind())
			}
		}
	}
	adminRegistry.entries = append(adminRegistry.entries, e)
	return nil
}

// sameConfig reports whether two handlers have the same configuration: a
// site block that listens on several addresses becomes several HTTP
// servers, each with its own copy of the handler, which keep its one name
// (they share their Redis state; the first answers for them).
func sameConfig(a, b *AdminEntry) bool {
	ja, errA := json.Marshal(a.Handler)
	jb, errB := json.Marshal(b.Handler)
	return errA == nil && errB == nil && bytes.Equal(ja, jb)
}

// Copies lists the running handlers of e's kind and name (e's first).
func Copies(e *AdminEntry) []AdminHandler {
	out := []AdminHandler{e.Handler}
	if e.name() == "" {
		return out
	}
	for _, o := range RunningHandlers() {
		if o != e && o.kind() == e.kind() && o.name() == e.name() {
			out = append(out, o.Handler)
		}
	}
	return out
}

// UnregisterAdmin forgets a handler (its Cleanup); it is a no-op for a
// handler that was never registered.
func UnregisterAdmin(h AdminHandler) {
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	out := adminRegistry.entries[:0]
	for _, e := range adminRegistry.entries {
		if e.Handler != h {
			out = append(out, e)
		}
	}
	clear(adminRegistry.entries[len(out):])
	adminRegistry.entries = out
}

// RunningHandlers lists the handlers of the running config (their
// positions in the admin API): by HTTP server name, then in provision order
// (the order of the server's routes), so positions stay the same across
// reloads of one config although Caddy provisions its servers in no set order.
func RunningHandlers() []*AdminEntry {
	root := caddy.ActiveContext()
	if root.Context == nil {
		return nil
	}
	active := root.Done()
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	var out []*AdminEntry
	for _, e := range adminRegistry.entries {
		if e.cfg == active {
			out = append(out, e)
		}
	}
	slices.SortStableFunc(out, func(a, b *AdminEntry) int { return naturalCompare(a.Server, b.Server) })
	return out
}

// FindHandler finds a handler of the running config of kind by its name or
// position.
func FindHandler(ref, kind string) (*AdminEntry, error) {
	list := RunningHandlers()
	if i, err := strconv.Atoi(ref); err == nil && ref == strconv.Itoa(i) {
		if i >= 0 && i < len(list) && list[i].kind() == kind {
			return list[i], nil
		}
		return nil, AdminError(http.StatusNotFound, "no %s handler at position %d; see GET /redisdlm/", kind, i)
	}
	for _, e := range list {
		if e.kind() == kind && e.name() == ref {
			return e, nil
		}
	}
	return nil, AdminError(http.StatusNotFound, "no %s handler named %q; see GET /redisdlm/", kind, ref)
}

// naturalCompare orders names with their numbers by value: srv2 before
// srv10, as the servers of an adapted Caddyfile are numbered.
func naturalCompare(a, b string) int {
	ta, na := splitNumber(a)
	tb, nb := splitNumber(b)
	if c := strings.Compare(ta, tb); c != 0 || na == nb {
		if c == 0 {
			return strings.Compare(a, b)
		}
		return c
	}
	if na < nb {
		return -1
	}
	return 1
}

// splitNumber splits a name into its text and the number that ends it
// (-1 when none does).
func splitNumber(s string) (string, int) {
	i := len(s)
	for i > 0 && s[i-1] >= '0' && s[i-1] <= '9' {
		i--
	}
	if i == len(s) || len(s)-i > 9 {
		return s, -1
	}
	n, _ := strconv.Atoi(s[i:])
	return s[:i], n
}

// displayServer names a logical Redis for the admin API as logs do, but
// without any user info (user name, password) or URL query.
func displayServer(s redisconn.Settings) string {
	c := s
	c.Addrs = make([]string, len(s.Addrs))
	for i, a := range s.Addrs {
		c.Addrs[i] = withoutUserinfo(a)
	}
	return c.Display()
}

// withoutUserinfo drops the user info and query of a redis URL; a
// host:port is returned as it is.
func withoutUserinfo(addr string) string {
	if !strings.Contains(addr, "://") {
		return addr
	}
	u, err := url.Parse(addr)
	if err != nil {
		return "(unparsable redis URL)"
	}
	u.User, u.RawQuery, u.Fragment = nil, "", ""
	return u.String()
}

// AdminError is the JSON error answer of Caddy's admin endpoint.
func AdminError(status int, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	return caddy.APIError{HTTPStatus: status, Err: err, Message: err.Error()}
}

// WriteJSON answers v as JSON.
func WriteJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "\t")
	return enc.Encode(v)
}

// HandlerRef names a handler in answers and logs.
func HandlerRef(name string) string {
	if name != "" {
		return name
	}
	return "(unnamed)"
}

// HandlerView is one handler in GET /redisdlm/.
type HandlerView struct {
	Position  int        `json:"position"`
	Name      string     `json:"name,omitempty"`
	Kind      string     `json:"kind"`
	Server    string     `json:"http_server,omitempty"` // the HTTP server (srv0, ...) it runs in
	Path      string     `json:"path"`                  // where its locks or quotas are
	Servers   []string   `json:"servers"`
	Prefix    string     `json:"prefix"`
	Keys      []string   `json:"keys"`
	Rates     []RateView `json:"rates,omitempty"`
	Algorithm string     `json:"algorithm,omitempty"`
}

// RateView is one rate of a rate-limit handler in GET /redisdlm/.
type RateView struct {
	Policy   string `json:"policy"`
	Requests int64  `json:"requests,omitempty"`
	Window   string `json:"window,omitempty"`
	// A rate rendered per request (a plan): its `rate` arguments.
	Template string `json:"template,omitempty"`
}

// ListView is GET /redisdlm/: the handlers of list, at their positions.
func ListView(list []*AdminEntry) map[string]any {
	views := make([]HandlerView, 0, len(list))
	for i, e := range list {
		ref := e.name()
		if ref == "" {
			ref = strconv.Itoa(i)
		}
		v := HandlerView{Position: i, Name: e.name(), Kind: e.kind(), Server: e.Server, Servers: e.Servers}
		for seg, kind := range AdminSegments {
			if kind == e.kind() {
				v.Path = "/redisdlm/" + seg + "/" + ref + "/"
			}
		}
		e.Handler.AdminView(&v)
		views = append(views, v)
	}
	return map[string]any{"handlers": views}
}

package redisdlm

// The admin API, admin.api.redisdlm: served on Caddy's admin endpoint (with
// its access controls), it lists the handlers of the running config and lets
// an operator inspect and force-release a lock, and inspect and reset a
// rate-limit quota, without redis-cli:
//
//	GET    /redisdlm/                             the handlers of the running config
//	GET    /redisdlm/locks/<handler>/<key>        holders, fence, waiters, stored replay
//	POST   /redisdlm/locks/<handler>/<key>/release force-release the lock
//	DELETE /redisdlm/locks/<handler>/<key>/replay  clear the run record and stored answer
//	GET    /redisdlm/limits/<handler>/<key>       per rate: used, remaining, reset
//	DELETE /redisdlm/limits/<handler>/<key>       reset that key's quota
//
// <handler> is a handler's `name`, or its position in the list; <key> is
// the rendered key, URL-escaped. The rate limiter's side is in
// ratelimit_inspect.go.

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// AdminAPI is the admin.api.redisdlm module. It has no configuration: Caddy
// loads every admin.api module on its admin endpoint, so the routes are
// there whenever this plugin is built in, under the endpoint's own access
// controls (listen address, origins, remote admin).
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.redisdlm",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Routes returns the admin routes, all under /redisdlm/.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/redisdlm/", Handler: caddy.AdminHandlerFunc(a.serve)}}
}

// adminEntry is one provisioned handler, as the admin API sees it.
type adminEntry struct {
	cfg     <-chan struct{} // Done of the context of the config that loaded it
	server  string          // the name of the HTTP server (srv0, ...) it runs in
	lock    *RedisLock      // one of lock and limit is set
	limit   *RedisRateLimit
	servers []string // display forms, without user info
}

// serverName is the display form of server i ("" when unknown).
func (e *adminEntry) serverName(i int) string {
	if i < len(e.servers) {
		return e.servers[i]
	}
	return ""
}

func (e *adminEntry) kind() string {
	if e.lock != nil {
		return "redis_lock"
	}
	return "redis_ratelimit"
}

func (e *adminEntry) name() string {
	if e.lock != nil {
		return e.lock.Name
	}
	return e.limit.Name
}

// adminRegistry holds every provisioned handler, in provision order; the
// admin API shows those of the running config.
var adminRegistry struct {
	mu      sync.Mutex
	entries []*adminEntry
}

// adminRegister records a provisioned handler (the last step of its
// Provision). A name must be unique among the handlers of one kind in one
// config.
func adminRegister(ctx caddy.Context, h any) error {
	// A handler's context is its config's root context with values added
	// (the HTTP server), so its Done channel is the root's: it identifies
	// the config load.
	e := &adminEntry{cfg: ctx.Done()}
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		e.server = srv.Name()
	}
	var rc *shared.RedisConfig
	switch h := h.(type) {
	case *RedisLock:
		e.lock, rc = h, &h.RedisConfig
	case *RedisRateLimit:
		e.limit, rc = h, &h.RedisConfig
	default:
		return fmt.Errorf("redisdlm: admin registry: unexpected handler %T", h)
	}
	name := e.name()
	if name != "" {
		if err := shared.CheckHandlerName(name); err != nil {
			return fmt.Errorf("%s: name: %w", e.kind(), err)
		}
	}
	settings, err := rc.Resolve()
	if err != nil {
		return fmt.Errorf("%s: %w", e.kind(), err)
	}
	for _, s := range settings {
		e.servers = append(e.servers, displayServer(s))
	}
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	if name != "" {
		for _, o := range adminRegistry.entries {
			if o.cfg == e.cfg && o.kind() == e.kind() && o.name() == name && (o.server == e.server || !sameConfig(o, e)) {
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
func sameConfig(a, b *adminEntry) bool {
	ja, errA := json.Marshal(a.handler())
	jb, errB := json.Marshal(b.handler())
	return errA == nil && errB == nil && bytes.Equal(ja, jb)
}

func (e *adminEntry) handler() any {
	if e.lock != nil {
		return e.lock
	}
	return e.limit
}

// copies lists the running handlers of e's kind and name (e first).
func copies(e *adminEntry) []*RedisRateLimit {
	out := []*RedisRateLimit{e.limit}
	if e.name() == "" {
		return out
	}
	for _, o := range runningHandlers() {
		if o != e && o.limit != nil && o.name() == e.name() {
			out = append(out, o.limit)
		}
	}
	return out
}

// adminUnregister forgets a handler (its Cleanup); it is a no-op for a
// handler that was never registered.
func adminUnregister(h any) {
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	out := adminRegistry.entries[:0]
	for _, e := range adminRegistry.entries {
		if (e.lock != nil && any(e.lock) == h) || (e.limit != nil && any(e.limit) == h) {
			continue
		}
		out = append(out, e)
	}
	clear(adminRegistry.entries[len(out):])
	adminRegistry.entries = out
}

// runningHandlers lists the handlers of the running config (their
// positions in the admin API): by HTTP server name, then in provision order
// (the order of the server's routes), so positions stay the same across
// reloads of one config although Caddy provisions its servers in no set order.
func runningHandlers() []*adminEntry {
	root := caddy.ActiveContext()
	if root.Context == nil {
		return nil
	}
	active := root.Done()
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	var out []*adminEntry
	for _, e := range adminRegistry.entries {
		if e.cfg == active {
			out = append(out, e)
		}
	}
	slices.SortStableFunc(out, func(a, b *adminEntry) int { return naturalCompare(a.server, b.server) })
	return out
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

// adminError is the JSON error answer of Caddy's admin endpoint.
func adminError(status int, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	return caddy.APIError{HTTPStatus: status, Err: err, Message: err.Error()}
}

// writeJSON answers v as JSON.
func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "\t")
	return enc.Encode(v)
}

// serve dispatches /redisdlm/... by its escaped path segments, so a key may
// hold "/" (escaped as %2F).
func (a *AdminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.EscapedPath(), "/redisdlm/")
	if rest == "" {
		if r.Method != http.MethodGet {
			return adminError(http.StatusMethodNotAllowed, "method %s not allowed; use GET", r.Method)
		}
		return writeJSON(w, listView(runningHandlers()))
	}
	parts := strings.Split(rest, "/")
	for i, p := range parts {
		v, err := url.PathUnescape(p)
		if err != nil {
			return adminError(http.StatusBadRequest, "bad escape in path segment %q", p)
		}
		parts[i] = v
	}
	// {locks|limits}/<handler>/<key>[/release|/replay]
	kinds := map[string]string{"locks": "redis_lock", "limits": "redis_ratelimit"}
	kind := kinds[parts[0]]
	release := len(parts) == 4 && parts[0] == "locks" && parts[3] == "release"
	replay := len(parts) == 4 && parts[0] == "locks" && parts[3] == "replay"
	if kind == "" || len(parts) != 3 && !release && !replay {
		return adminError(http.StatusNotFound, "no such redisdlm admin resource %q; see GET /redisdlm/", r.URL.Path)
	}
	e, err := findHandler(parts[1], kind)
	if err != nil {
		return err
	}
	key := parts[2]
	allowed := "GET or DELETE"
	switch {
	case release:
		if r.Method == http.MethodPost {
			return releaseLock(w, r, e, key)
		}
		allowed = "POST"
	case replay:
		if r.Method == http.MethodDelete {
			return clearReplay(w, r, e, key)
		}
		allowed = "DELETE"
	case e.lock != nil:
		if r.Method == http.MethodGet {
			return inspectLock(w, r, e, key)
		}
		allowed = "GET (POST .../release frees the lock)"
	case r.Method == http.MethodGet:
		return inspectQuota(w, r, e.limit, key)
	case r.Method == http.MethodDelete:
		return resetQuota(w, r, e.limit, copies(e), key)
	}
	return adminError(http.StatusMethodNotAllowed, "method %s not allowed; use %s", r.Method, allowed)
}

// findHandler finds a handler of the running config by name or position.
func findHandler(ref, kind string) (*adminEntry, error) {
	list := runningHandlers()
	if i, err := strconv.Atoi(ref); err == nil && ref == strconv.Itoa(i) {
		if i >= 0 && i < len(list) && list[i].kind() == kind {
			return list[i], nil
		}
		return nil, adminError(http.StatusNotFound, "no %s handler at position %d; see GET /redisdlm/", kind, i)
	}
	for _, e := range list {
		if e.kind() == kind && e.name() == ref {
			return e, nil
		}
	}
	return nil, adminError(http.StatusNotFound, "no %s handler named %q; see GET /redisdlm/", kind, ref)
}

// handlerView is one handler in GET /redisdlm/.
type handlerView struct {
	Position  int        `json:"position"`
	Name      string     `json:"name,omitempty"`
	Kind      string     `json:"kind"`
	Server    string     `json:"http_server,omitempty"` // the HTTP server (srv0, ...) it runs in
	Path      string     `json:"path"`                  // where its locks or quotas are
	Servers   []string   `json:"servers"`
	Prefix    string     `json:"prefix"`
	Keys      []string   `json:"keys"`
	Rates     []rateView `json:"rates,omitempty"`
	Algorithm string     `json:"algorithm,omitempty"`
}

type rateView struct {
	Policy   string `json:"policy"`
	Requests int64  `json:"requests,omitempty"`
	Window   string `json:"window,omitempty"`
	// A rate rendered per request (a plan): its `rate` arguments.
	Template string `json:"template,omitempty"`
}

func listView(list []*adminEntry) map[string]any {
	views := make([]handlerView, 0, len(list))
	for i, e := range list {
		ref := e.name()
		if ref == "" {
			ref = strconv.Itoa(i)
		}
		v := handlerView{Position: i, Name: e.name(), Kind: e.kind(), Server: e.server, Servers: e.servers}
		if e.lock != nil {
			v.Path, v.Prefix, v.Keys = "/redisdlm/locks/"+ref+"/", e.lock.Prefix, e.lock.Keys
		} else {
			v.Path, v.Prefix, v.Keys, v.Algorithm = "/redisdlm/limits/"+ref+"/", e.limit.Prefix, []string{e.limit.keyTemplateText()}, e.limit.algo
			for j, s := range e.limit.static.rates {
				rv := rateView{Policy: "r" + strconv.Itoa(j), Requests: s.n, Window: s.window.String()}
				if s.nTmpl != "" || s.wTmpl != "" {
					rv = rateView{Policy: rv.Policy, Template: s.rateTemplate()}
				}
				v.Rates = append(v.Rates, rv)
			}
		}
		views = append(views, v)
	}
	return map[string]any{"handlers": views}
}

// Interface guards
var _ caddy.AdminRouter = (*AdminAPI)(nil)

// Package redisadmin is the admin.api.redisdlm module: served on Caddy's
// admin endpoint (with its access controls), it lists the handlers of the
// running config and lets an operator inspect and force-release a lock, and
// inspect and reset a rate-limit quota, without redis-cli:
//
//	GET    /redisdlm/                              the handlers of the running config
//	GET    /redisdlm/locks/<handler>/<key>         holders, fence, waiters, stored replay, in doubt
//	POST   /redisdlm/locks/<handler>/<key>/release force-release the lock
//	DELETE /redisdlm/locks/<handler>/<key>/replay  clear the run record and stored answer
//	GET    /redisdlm/limits/<handler>/<key>        per rate: used, remaining, reset
//	DELETE /redisdlm/limits/<handler>/<key>        reset that key's quota
//
// <handler> is a handler's `name`, or its position in the list; <key> is
// the rendered key, URL-escaped. The handlers register in internal/shared's
// registry and answer for their keys themselves; this module routes.
package redisadmin

import (
	"net/http"
	"net/url"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
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

// serve dispatches /redisdlm/... by its escaped path segments, so a key may
// hold "/" (escaped as %2F): {locks|limits}/<handler>/<key>[/<sub>].
func (a *AdminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.EscapedPath(), "/redisdlm/")
	if rest == "" {
		if r.Method != http.MethodGet {
			return shared.AdminError(http.StatusMethodNotAllowed, "method %s not allowed; use GET", r.Method)
		}
		return shared.WriteJSON(w, shared.ListView(shared.RunningHandlers()))
	}
	parts := strings.Split(rest, "/")
	for i, p := range parts {
		v, err := url.PathUnescape(p)
		if err != nil {
			return shared.AdminError(http.StatusBadRequest, "bad escape in path segment %q", p)
		}
		parts[i] = v
	}
	kind := shared.AdminSegments[parts[0]]
	if kind == "" || len(parts) != 3 && len(parts) != 4 {
		return notFound(r)
	}
	e, err := shared.FindHandler(parts[1], kind)
	if err != nil {
		return err
	}
	sub := ""
	if len(parts) == 4 {
		sub = parts[3]
	}
	return e.Handler.ServeAdmin(w, r, e, parts[2], sub)
}

func notFound(r *http.Request) error {
	return shared.AdminError(http.StatusNotFound, "no such redisdlm admin resource %q; see GET /redisdlm/", r.URL.Path)
}

// Interface guards
var _ caddy.AdminRouter = (*AdminAPI)(nil)

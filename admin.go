package redisdlm

// The admin API, admin.api.redisdlm: served on Caddy's admin endpoint (with
// its access controls), it lists the handlers of the running config and lets
// an operator inspect and force-release a lock, and inspect and reset a
// rate-limit quota, without redis-cli:
//
//	GET    /redisdlm/                             the handlers of the running config
//	GET    /redisdlm/locks/<handler>/<key>        holders, fence, waiters, stored replay
//	POST   /redisdlm/locks/<handler>/<key>/release force-release the lock
//	GET    /redisdlm/limits/<handler>/<key>       per rate: used, remaining, reset
//	DELETE /redisdlm/limits/<handler>/<key>       reset that key's quota
//
// <handler> is a handler's `name`, or its position in the list; <key> is
// the rendered key, URL-escaped. The rate limiter's side is in
// ratelimit_inspect.go.

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

var (
	//go:embed scripts/admin_lock_inspect.lua
	adminLockInspectLua string
	//go:embed scripts/admin_lock_release.lua
	adminLockReleaseLua string

	adminLockInspectScript = redis.NewScript(adminLockInspectLua)
	adminLockReleaseScript = redis.NewScript(adminLockReleaseLua)
)

// adminWakeFrom is the sender of the wake-up a force release publishes: no
// domain has this id, so every instance's waiters of the key are woken.
const adminWakeFrom = "admin"

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
	lock    *RedisLock      // one of lock and limit is set
	limit   *RedisRateLimit
	servers []string // display forms, without user info
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
	var rc *RedisConfig
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
		if err := checkHandlerName(name); err != nil {
			return fmt.Errorf("%s: name: %w", e.kind(), err)
		}
	}
	settings, err := rc.resolve()
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
			if o.cfg == e.cfg && o.kind() == e.kind() && o.name() == name {
				return fmt.Errorf("%s: name: %q is already the name of another %s handler in this config", e.kind(), name, e.kind())
			}
		}
	}
	adminRegistry.entries = append(adminRegistry.entries, e)
	return nil
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

// runningHandlers lists the handlers of the running config, in provision
// order (their positions in the admin API).
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
	return out
}

// checkHandlerName accepts letters, digits, '-', '_' and '.', not all
// digits (a number addresses a handler by its position).
func checkHandlerName(name string) error {
	if name == "" {
		return errors.New("must not be empty")
	}
	digits := true
	for _, c := range name {
		switch {
		case c >= '0' && c <= '9':
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c == '-', c == '_', c == '.':
			digits = false
		default:
			return fmt.Errorf("%q: use letters, digits, '-', '_' and '.' only", name)
		}
	}
	if digits {
		return fmt.Errorf("%q: must not be all digits (a number addresses a handler by its position)", name)
	}
	return nil
}

// displayServer names a logical Redis for the admin API: addresses only,
// never user info (user name, password) or URL query.
func displayServer(s serverSettings) string {
	addrs := make([]string, len(s.Addrs))
	for i, a := range s.Addrs {
		addrs[i] = withoutUserinfo(a)
	}
	switch s.Mode {
	case "cluster":
		return "cluster " + strings.Join(addrs, ",")
	case "sentinel":
		return "sentinel " + s.Master + "@" + strings.Join(addrs, ",")
	}
	return strings.Join(addrs, ",")
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
	// {locks|limits}/<handler>/<key>[/release]
	kinds := map[string]string{"locks": "redis_lock", "limits": "redis_ratelimit"}
	kind := kinds[parts[0]]
	release := len(parts) == 4 && parts[0] == "locks" && parts[3] == "release"
	if kind == "" || len(parts) != 3 && !release {
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
			return releaseLock(w, r, e.lock, key)
		}
		allowed = "POST"
	case e.lock != nil:
		if r.Method == http.MethodGet {
			return inspectLock(w, r, e.lock, key)
		}
		allowed = "GET (POST .../release frees the lock)"
	case r.Method == http.MethodGet:
		return inspectQuota(w, r, e.limit, key)
	case r.Method == http.MethodDelete:
		return resetQuota(w, r, e.limit, key)
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
	Path      string     `json:"path"` // where its locks or quotas are
	Servers   []string   `json:"servers"`
	Prefix    string     `json:"prefix"`
	Keys      []string   `json:"keys"`
	Rates     []rateView `json:"rates,omitempty"`
	Algorithm string     `json:"algorithm,omitempty"`
}

type rateView struct {
	Policy   string `json:"policy"`
	Requests int64  `json:"requests"`
	Window   string `json:"window"`
}

func listView(list []*adminEntry) map[string]any {
	views := make([]handlerView, 0, len(list))
	for i, e := range list {
		ref := e.name()
		if ref == "" {
			ref = strconv.Itoa(i)
		}
		v := handlerView{Position: i, Name: e.name(), Kind: e.kind(), Servers: e.servers}
		if e.lock != nil {
			v.Path, v.Prefix, v.Keys = "/redisdlm/locks/"+ref+"/", e.lock.Prefix, e.lock.Keys
		} else {
			v.Path, v.Prefix, v.Keys, v.Algorithm = "/redisdlm/limits/"+ref+"/", e.limit.Prefix, []string{e.limit.keyTemplateText()}, e.limit.algo
			for j, s := range e.limit.rates {
				v.Rates = append(v.Rates, rateView{Policy: "r" + strconv.Itoa(j), Requests: s.n, Window: s.window.String()})
			}
		}
		views = append(views, v)
	}
	return map[string]any{"handlers": views}
}

// The lock engine, read through these accessors only (it changes often).

// lockClients returns the clients of the lock's servers, in config order.
func lockClients(h *RedisLock) []redis.UniversalClient {
	out := make([]redis.UniversalClient, len(h.locker.servers))
	for i, s := range h.locker.servers {
		out[i] = s.client
	}
	return out
}

// lockInstanceID is this instance's id in the lock's Redis wait lists.
func lockInstanceID(h *RedisLock) string { return h.locker.dom.id }

// lockLocal counts this instance's waiters and holders of a Redis lock key,
// over every local queue that involves it (a key set holding it).
func lockLocal(h *RedisLock, redisKey string) (waiters, held int) {
	d := h.locker.dom
	d.mu.Lock()
	w := wakeID(redisKey)
	qs := make([]*keyQueue, 0, len(d.byWake[w]))
	for q := range d.byWake[w] {
		qs = append(qs, q)
	}
	d.mu.Unlock()
	for _, q := range qs {
		q.mu.Lock()
		waiters += len(q.waiters)
		held += q.held
		q.mu.Unlock()
	}
	return waiters, held
}

// lockWakeLocal wakes this instance's waiters of a Redis lock key.
func lockWakeLocal(h *RedisLock, redisKey string) { h.locker.dom.wakeKeys([]string{redisKey}) }

// lockServerView is one server's state of a lock key.
type lockServerView struct {
	Server           string       `json:"server"`
	Error            string       `json:"error,omitempty"`
	HolderCount      int          `json:"holder_count"`
	Holders          []holderView `json:"holders"`
	FencingCounter   *int64       `json:"fencing_counter"`
	InstancesWaiting int          `json:"instances_waiting"`
	ThisInstanceWait bool         `json:"this_instance_waiting"`
	Replay           *replayView  `json:"replay"`
}

// holderView is one holder; its token is a secret (it releases the lock)
// and is never shown.
type holderView struct {
	LeaseLeftMs int64 `json:"lease_left_ms"`
}

// replayView is a response stored for replay under <lockkey>:replay.
type replayView struct {
	Type     string `json:"type"`
	Status   *int64 `json:"status"`
	Size     int64  `json:"size"`
	ExpiryMs int64  `json:"expires_in_ms"`
}

// lockView is GET /redisdlm/locks/<handler>/<key>.
type lockView struct {
	Handler     string           `json:"handler"`
	Key         string           `json:"key"`
	RedisKey    string           `json:"redis_key"`
	Held        bool             `json:"held"` // a holder on a majority of servers
	WaitersHere int              `json:"waiters_here"`
	HeldHere    int              `json:"held_here"`
	Servers     []lockServerView `json:"servers"`
}

// fanOut runs f on every client in parallel, bounded by the handler's
// timeout per call.
func fanOut(ctx context.Context, clients []redis.UniversalClient, timeout time.Duration, f func(ctx context.Context, i int, c redis.UniversalClient)) {
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			f(cctx, i, c)
		}()
	}
	wg.Wait()
}

func lockTimeout(h *RedisLock) time.Duration {
	if h.Timeout > 0 {
		return time.Duration(h.Timeout)
	}
	return DefaultTimeout
}

// handlerRef names a handler in answers and logs.
func handlerRef(name string) string {
	if name != "" {
		return name
	}
	return "(unnamed)"
}

func inspectLock(w http.ResponseWriter, r *http.Request, h *RedisLock, key string) error {
	if key == "" {
		return adminError(http.StatusBadRequest, "empty lock key")
	}
	rk := storedKey(h.Prefix, key)
	v := lockView{Handler: handlerRef(h.Name), Key: key, RedisKey: rk}
	v.WaitersHere, v.HeldHere = lockLocal(h, rk)
	clients := lockClients(h)
	v.Servers = make([]lockServerView, len(clients))
	servers := adminServers(h)
	found := v.WaitersHere > 0 || v.HeldHere > 0
	var mu sync.Mutex
	withHolders := 0
	fanOut(r.Context(), clients, lockTimeout(h), func(ctx context.Context, i int, c redis.UniversalClient) {
		sv := lockServerView{Server: servers[i], Holders: []holderView{}}
		res, err := adminLockInspectScript.Run(ctx, c,
			[]string{rk, fenceKey(rk), waitqKey(rk), rk + ":replay"}, lockInstanceID(h)).Slice()
		if err == nil {
			err = sv.fill(res)
		}
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			sv.Error = err.Error()
		} else {
			if sv.HolderCount > 0 {
				withHolders++
			}
			if sv.HolderCount > 0 || sv.FencingCounter != nil || sv.InstancesWaiting > 0 || sv.Replay != nil {
				found = true
			}
		}
		v.Servers[i] = sv
	})
	v.Held = withHolders >= len(clients)/2+1
	if !found {
		for _, s := range v.Servers {
			if s.Error != "" {
				return adminError(http.StatusBadGateway, "redis %s: %s", s.Server, s.Error)
			}
		}
		return adminError(http.StatusNotFound, "no lock state for key %q (Redis key %s)", key, rk)
	}
	return writeJSON(w, v)
}

// fill reads the inspect script's answer:
// {holders' lease left ms {..}, fence or "", waiting instances, this
// instance waiting 0|1, replay type, replay expiry ms, replay status or "",
// replay size}.
func (sv *lockServerView) fill(res []any) error {
	if len(res) != 8 {
		return fmt.Errorf("unexpected inspect answer of %d values", len(res))
	}
	left, _ := res[0].([]any)
	for _, l := range left {
		ms, _ := l.(int64)
		sv.Holders = append(sv.Holders, holderView{LeaseLeftMs: ms})
	}
	sv.HolderCount = len(sv.Holders)
	if s, _ := res[1].(string); s != "" {
		if f, err := strconv.ParseInt(s, 10, 64); err == nil {
			sv.FencingCounter = &f
		}
	}
	n, _ := res[2].(int64)
	sv.InstancesWaiting = int(n)
	me, _ := res[3].(int64)
	sv.ThisInstanceWait = me == 1
	if typ, _ := res[4].(string); typ != "none" && typ != "" {
		rv := &replayView{Type: typ}
		rv.ExpiryMs, _ = res[5].(int64)
		if s, _ := res[6].(string); s != "" {
			if st, err := strconv.ParseInt(s, 10, 64); err == nil {
				rv.Status = &st
			}
		}
		rv.Size, _ = res[7].(int64)
		sv.Replay = rv
	}
	return nil
}

// adminServers returns the display names of a handler's servers.
func adminServers(h any) []string {
	adminRegistry.mu.Lock()
	defer adminRegistry.mu.Unlock()
	for _, e := range adminRegistry.entries {
		if (e.lock != nil && any(e.lock) == h) || (e.limit != nil && any(e.limit) == h) {
			return e.servers
		}
	}
	return nil
}

// releaseLock force-releases every holder of a lock key on every server
// and wakes the key's waiters in every instance. An old holder's next
// extension then finds its lease lost (the key's fencing counter is still
// there, so no extension re-creates the lease) and on_lost applies.
func releaseLock(w http.ResponseWriter, r *http.Request, h *RedisLock, key string) error {
	if key == "" {
		return adminError(http.StatusBadRequest, "empty lock key")
	}
	rk := storedKey(h.Prefix, key)
	clients := lockClients(h)
	servers := adminServers(h)
	removed := make([]int64, len(clients))
	errs := make([]string, len(clients))
	fanOut(r.Context(), clients, lockTimeout(h), func(ctx context.Context, i int, c redis.UniversalClient) {
		n, err := adminLockReleaseScript.Run(ctx, c, []string{rk}, wakeChannel, adminWakeFrom+" "+wakeID(rk)).Int64()
		removed[i] = n
		if err != nil {
			errs[i] = err.Error()
		}
	})
	lockWakeLocal(h, rk)
	total := int64(0)
	type serverResult struct {
		Server  string `json:"server"`
		Removed int64  `json:"holders_removed"`
		Error   string `json:"error,omitempty"`
	}
	out := struct {
		Handler  string         `json:"handler"`
		Key      string         `json:"key"`
		RedisKey string         `json:"redis_key"`
		Servers  []serverResult `json:"servers"`
	}{Handler: handlerRef(h.Name), Key: key, RedisKey: rk}
	failed := 0
	for i := range clients {
		total += removed[i]
		if errs[i] != "" {
			failed++
		}
		out.Servers = append(out.Servers, serverResult{Server: servers[i], Removed: removed[i], Error: errs[i]})
	}
	if total == 0 {
		if failed > 0 {
			return adminError(http.StatusBadGateway, "releasing %q: %d of %d servers failed: %s", key, failed, len(clients), strings.Join(errs, "; "))
		}
		return adminError(http.StatusNotFound, "lock key %q (Redis key %s) is not held", key, rk)
	}
	h.logger.Warn("lock force-released through the admin API",
		zap.String("key", key), zap.String("handler", out.Handler), zap.Int64("holders_removed", total), zap.Int("servers_failed", failed))
	return writeJSON(w, out)
}

// Interface guards
var _ caddy.AdminRouter = (*AdminAPI)(nil)

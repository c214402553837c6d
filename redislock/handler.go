// Package redislock is the http.handlers.redis_lock module and its
// Caddyfile directive: it holds a distributed lock in Redis per key while
// the rest of the route serves the request, hands the upstream a fencing
// token, can execute a request once (replay), and answers the admin API
// for its keys. The lock itself is the engine's (internal/lock); this
// package renders the keys, serves HTTP around the lease and reports.
package redislock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(RedisLock{})
}

// Defaults of redis_lock.
const (
	DefaultLockTTL       = 30 * time.Second
	DefaultLockWait      = 10 * time.Second
	DefaultBackoffMin    = 10 * time.Millisecond
	DefaultBackoffMax    = 500 * time.Millisecond
	DefaultFencingHeader = shared.DefaultFencingHeader
	DefaultLockStatus    = http.StatusLocked
	DefaultLockPrefix    = "caddy:lock:"
	DefaultLockKey       = shared.DefaultLockKey
)

// RedisLock holds a distributed lock in Redis per key while the rest of the
// route (for example reverse_proxy) serves the request, so requests for one
// key are served one at a time across every Caddy instance that shares the
// Redis server(s).
//
// The lock is a lease: it runs out after `ttl` unless extended, and it is
// extended every ttl/3 while the request runs. The next handler receives a
// fencing token, a number that strictly increases with every acquisition of
// a key, in the `fencing_header` request header; an upstream that stores the
// highest token it has seen and rejects lower ones is safe even when a
// paused or partitioned holder outlives its lease.
//
// With several `redis` servers (3, 5 or 7) the lock is a Redlock quorum: it
// is held when a majority of independent servers granted it in time.
type RedisLock struct {
	// Key templates, rendered per request with Caddy placeholders, such as
	// `{http.request.header.X-User-ID}` or `{http.auth.user.id}`. With several
	// keys the request holds all of them or none; keys are deduplicated and
	// taken in sorted order, so two requests naming the same keys in another
	// order cannot deadlock. A rendered key longer than 200 bytes is stored
	// as its SHA-256. A key that renders empty, or that uses a placeholder
	// unknown at request time, is answered with 400.
	// Default: `{http.request.uri.path}`.
	Keys []string `json:"keys,omitempty"`

	// Lease of one acquisition: a holder that crashes blocks the key at most
	// this long. Default: 30s.
	TTL caddy.Duration `json:"ttl,omitempty"`

	// Longest time a request waits for the lock before it is answered with
	// `status`. 0 fails fast: a busy lock is answered at once.
	// Default: 10s.
	Wait *caddy.Duration `json:"wait,omitempty"`

	// Shortest pause between two polls of a busy lock. Polling is only the
	// fallback: waiters are woken when the lock is released. Delays grow
	// exponentially from backoff_min to backoff_max with full jitter, and
	// never pass the holder's remaining lease. Default: 10ms.
	BackoffMin caddy.Duration `json:"backoff_min,omitempty"`

	// Longest pause between two polls of a busy lock. Default: 500ms.
	BackoffMax caddy.Duration `json:"backoff_max,omitempty"`

	// Extend the lease every ttl/3 while the request runs, so a slow
	// upstream keeps the lock. Default: true.
	AutoExtend *bool `json:"auto_extend,omitempty"`

	// Stop extending after this long; the lease then runs out after at most
	// one more ttl and `on_lost` applies. 0 extends for as long as the
	// request runs. Default: 0.
	MaxHold caddy.Duration `json:"max_hold,omitempty"`

	// How many requests may hold one key at once (a semaphore). Every holder
	// has its own lease and its own fencing token. Default: 1.
	Permits int `json:"permits,omitempty"`

	// Most requests that may wait for one key in this Caddy instance; more
	// are answered with `status` at once. 0 means no cap. Default: 0.
	MaxWaiters int `json:"max_waiters,omitempty"`

	// Request header that carries the fencing token to the next handler.
	// Any value the client sent in it is replaced. "off" sends none. It
	// must not be a hop-by-hop header, Host, Content-Length, Authorization,
	// a header a key or fingerprint placeholder reads, or (under replay)
	// Cookie: the token would replace what the request needs.
	// Default: Lock-Fencing-Token.
	FencingHeader string `json:"fencing_header,omitempty"`

	// HTTP status when the wait runs out or max_waiters is full; it comes
	// with Retry-After in whole seconds (at least 1): this key's estimate of
	// when the lock is free for the client. Before this handler has seen a
	// hold end, that is the time left on the current lease; then it is the
	// current holder's grant (by the Redis server's clock, so also for a
	// holder on another instance) plus the 90th percentile of the holds
	// this handler saw, plus that percentile again for every request queued
	// ahead (in this instance, and one per other instance waiting in Redis),
	// plus one `timeout` for the release to reach Redis. It is never capped
	// by the lease, which auto-extension keeps near ttl. Default: 423.
	Status int `json:"status,omitempty"`

	// What to do when an extension finds the lease lost mid-request:
	// "cancel" cancels the request's context (the next handler stops; a
	// response not yet started becomes 503), "continue" lets it finish.
	// Both log an error and count caddy_redis_lock_lost_total.
	// Default: cancel.
	OnLost string `json:"on_lost,omitempty"`

	// Serve the request without a lock when Redis (or the Redlock quorum) is
	// unreachable, instead of answering 503. Default: false.
	FailOpen bool `json:"fail_open,omitempty"`

	// With a replicated Redis, count a grant only once this many replicas
	// acknowledged it: the acquire script and WAIT run in one pipeline on the
	// key's own master (on a Cluster, the master of the key's slot), and WAIT
	// gives up after half of `timeout`. A grant with too few acknowledgements
	// is released at once and answered like an unreachable Redis (503, or
	// unlocked with fail_open), the error saying how many replicas
	// acknowledged. A failover to a replica that acknowledged keeps the lease;
	// extensions are still replicated asynchronously. Needs n replicas or
	// every lock fails. 0 does not wait. Default: 0.
	SyncReplicas int `json:"sync_replicas,omitempty"`

	// Namespace of the Redis keys. Default: "caddy:lock:".
	Prefix string `json:"prefix,omitempty"`

	// Execute once: keep the holder's response (status, headers without
	// hop-by-hop ones, body) in Redis this long, stored by the same script
	// that releases the lock. Every request with the same key that waited
	// for the lock, in any Caddy instance, and every one that arrives within
	// this time gets the stored response, with `Idempotent-Replayed: true`,
	// instead of running the rest of the route.
	//
	// Never twice: for an unsafe method the upstream sees at most one run
	// per key within this window. The grant writes a run record (with the
	// fingerprint) that lives this long; a duplicate that finds it with no
	// live lease (the holder paused or crashed past it) gets 409 with
	// Retry-After. A 5xx the route wrote, a 408, 409, 425 or 429, or a
	// request reverse_proxy could not deliver clears it; any other unstored
	// end leaves the key in doubt until the record ends or DELETE
	// /redisdlm/locks/<name>/<key>/replay clears it. An answer that would
	// start after the holder's own clock says its lease ended goes out
	// only once stored as the run's own (else 503).
	//
	// The answer outlives the client: a client that goes away does not cut
	// the route short. The route runs to its end on a context the client's
	// departure does not cancel (bounded by max_hold if set, else one ttl
	// after the client left), the lock stays held, and the answer is
	// stored for the client's retry. The request body is buffered (up to
	// replay_max; a larger one is answered 413).
	//
	// Not stored: 5xx; 206, 304, 408, 409, 425 and 429; for GET and HEAD
	// every status HTTP caching does not store by default (only 200, 203,
	// 204, 300, 301, 308, 404, 405, 410 and 414 are kept); answers to
	// requests carrying Range or If-* headers; `Vary: *`; a body over
	// replay_max; a stream (server-sent events, 101); an answer the route
	// broke off (it returned an error); a lost lease (an unsafe method's
	// answer is still stored over its own run record). Then GET and HEAD
	// waiters take the lock in turn and run the route; an unsafe method's
	// key is cleared or in doubt as above.
	//
	// A stored answer is given only to requests it can answer: the same
	// fingerprint (which covers the credentials), the same values of the
	// headers its `Vary` names, no Range or If-* header, and for an answer
	// marked `Cache-Control: private` or `no-store` or carrying
	// `Set-Cookie`, the same credentials and (without credential_cookies)
	// the same Cookie header. Any other request with the key gets 422 if
	// its method is unsafe; a GET or HEAD runs the route itself, without
	// the lock. A response is replayed to anyone presenting the same key
	// and credentials: put the user in the key. Needs one key, one permit
	// and one Redis (a server, Cluster or Sentinel; not a Redlock quorum).
	// 0 turns it off. Default: 0.
	Replay caddy.Duration `json:"replay,omitempty"`

	// The largest response body kept for replay, in bytes; also the
	// largest request body under replay (a larger one is answered 413).
	// At most 268435456 (256 MiB): a stored answer is one Redis
	// string, which Redis caps at 512 MB, and the body is kept in memory
	// until it is stored. Default: 1048576 (1 MiB).
	ReplayMax int64 `json:"replay_max,omitempty"`

	// What a replayed request must match beyond the key, as templates
	// rendered per request; a request whose key has a stored response but
	// whose fingerprint differs never gets it (422 for an unsafe method; a
	// GET or HEAD runs the route itself). The credentials (Authorization,
	// Proxy-Authorization and the credential_cookies) are always part of
	// it. ["off"] skips the check (private answers still go only to the
	// same credentials). Default: the method, the URI, the SHA-256 of the
	// request body and the credentials.
	Fingerprint []string `json:"fingerprint,omitempty"`

	// Cookies that identify the client (a session cookie) and so join the
	// credentials of the fingerprint. With none named, a private answer
	// (Cache-Control private or no-store, or Set-Cookie) is replayed only
	// to a request with the same whole Cookie header; the whole header is
	// not part of every fingerprint, since a rotating analytics cookie
	// would then break a browser's retry. Default: none.
	CredentialCookies []string `json:"credential_cookies,omitempty"`

	// After a lease ends without its holder's release, the key is granted
	// to nobody for this long (Consul's lock-delay), so writes of a stale
	// holder still on their way can drain before the next holder starts. A
	// lease ends without its release when it expires, is force-released
	// through the admin API, is lost (an extension found it gone), or is
	// given back because the client went away while the rest of the route
	// still ran (its upstream may still be writing). A clean release, when
	// the route returned, has no delay; neither has the background release
	// of an acquire whose answer was lost. Each Redis server (every member
	// of a Redlock) keeps the delay in a companion key that expires with it;
	// waiters poll (every backoff_max at most) and get the key once it ends.
	// With permits, the delay holds the permit the lease held. 0 turns it
	// off. Default: 0.
	LockDelay caddy.Duration `json:"lock_delay,omitempty"`

	// Raise Retry-After by a random share of it, up to this fraction (0.2:
	// up to 20% later), so rejected clients do not all come back at the
	// same moment. Never lowers it; applied before rounding up to whole
	// seconds. Between 0 and 1. Default: 0.
	Jitter float64 `json:"jitter,omitempty"`

	// How the admin API (admin.api.redisdlm) names this handler: its locks
	// are at /redisdlm/locks/<name>/<key>. Letters, digits, `-`, `_` and
	// `.`, not all digits; unique among the redis_lock handlers of one
	// config. It is also the handler label of its metrics, log lines and
	// events. Default: none (the handler is addressed by its position in
	// the admin API's list, and labelled "lock-" and a short hash of its
	// config).
	Name string `json:"name,omitempty"`

	// Redis connection settings.
	shared.RedisConfig

	logger   *zap.Logger
	label    string // the name, else a short hash of the JSON config
	m        shared.LockSeries
	obs      *shared.LabelClaim
	events   shared.Emitter
	keyTmpls []*shared.KeyTemplate
	locker   *locker
	holds    *holdTimes
	timeout  time.Duration // bound of one Redis call (the release's, in Retry-After)
	poolKeys []string
	hook     *serverHook // its server's connection hooks (see afterresponse.go)
	warn     *shared.Warnings
}

// CaddyModule returns the Caddy module information.
func (RedisLock) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.redis_lock",
		New: func() caddy.Module { return new(RedisLock) },
	}
}

// Provision sets defaults, then takes the shared Redis clients. It never
// dials Redis: connections are made by the first request.
func (h *RedisLock) Provision(ctx caddy.Context) error {
	h.label = shared.HandlerLabel("lock", h.Name, h)
	h.logger = ctx.Logger().With(zap.String("handler", h.label))
	h.events = shared.NewEmitter(ctx)
	h.warn = shared.NewWarnings(time.Second)
	h.holds = new(holdTimes)
	if err := shared.RegisterMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	if len(h.Keys) == 0 {
		h.Keys = []string{DefaultLockKey}
	}
	if h.TTL == 0 {
		h.TTL = caddy.Duration(DefaultLockTTL)
	}
	if h.Wait == nil {
		w := caddy.Duration(DefaultLockWait)
		h.Wait = &w
	}
	if h.BackoffMin == 0 {
		h.BackoffMin = caddy.Duration(DefaultBackoffMin)
	}
	if h.BackoffMax == 0 {
		h.BackoffMax = caddy.Duration(DefaultBackoffMax)
		if h.BackoffMax < h.BackoffMin {
			h.BackoffMax = h.BackoffMin
		}
	}
	if h.AutoExtend == nil {
		on := true
		h.AutoExtend = &on
	}
	if h.Permits == 0 {
		h.Permits = 1
	}
	if h.FencingHeader == "" {
		h.FencingHeader = DefaultFencingHeader
	}
	if h.Status == 0 {
		h.Status = DefaultLockStatus
	}
	if h.OnLost == "" {
		h.OnLost = "cancel"
	}
	if h.Prefix == "" {
		h.Prefix = DefaultLockPrefix
	}
	if h.ReplayMax == 0 {
		h.ReplayMax = DefaultReplayMax
	}
	if err := h.Validate(); err != nil {
		return err
	}
	for _, k := range h.Keys {
		t, err := shared.ParseKeyTemplate(k)
		if err != nil {
			return fmt.Errorf("redis_lock: key: %w", err)
		}
		h.keyTmpls = append(h.keyTmpls, t)
	}

	settings, err := h.RedisConfig.Resolve()
	if err != nil {
		return fmt.Errorf("redis_lock: %w", err)
	}
	servers := make([]*server, 0, len(settings))
	clients := make([]*shared.Client, 0, len(settings))
	for _, s := range settings {
		pc, key, err := shared.AcquireClient(s)
		if err != nil {
			return fmt.Errorf("redis_lock: loading redis client for %s: %w", s.Display(), err)
		}
		h.poolKeys = append(h.poolKeys, key)
		servers = append(servers, pc.Lock)
		clients = append(clients, pc)
	}
	h.m = shared.NewLockSeries(h.label)
	h.obs = shared.ObserveHandler("lock", h.label, h.logger, clients...)
	timeout := settings[0].Timeout
	h.timeout = timeout
	h.locker = lock.New(servers, lockOptions{
		TTL:          time.Duration(h.TTL),
		Wait:         time.Duration(*h.Wait),
		BackoffMin:   time.Duration(h.BackoffMin),
		BackoffMax:   time.Duration(h.BackoffMax),
		Permits:      h.Permits,
		MaxWaiters:   h.MaxWaiters,
		Timeout:      timeout,
		SyncReplicas: h.SyncReplicas,
		Replay:       time.Duration(h.Replay),
		LockDelay:    time.Duration(h.LockDelay),
		Handler:      h.label,
	}, shared.SlogFor(h.logger))
	if err := shared.RegisterAdmin(ctx, h, &h.RedisConfig); err != nil {
		return err
	}
	h.hook = afterResponse.hookServer(ctx) // last: Cleanup undoes it
	return nil
}

// Validate checks the configuration; it is pure.
func (h *RedisLock) Validate() error {
	if err := h.RedisConfig.Validate(true); err != nil {
		return fmt.Errorf("redis_lock: %w", err)
	}
	for _, k := range h.Keys {
		if err := shared.CheckKeyTemplate(k); err != nil {
			return fmt.Errorf("redis_lock: key: %w", err)
		}
	}
	for _, f := range h.Fingerprint {
		if err := shared.CheckTemplate(f); err != nil {
			return fmt.Errorf("redis_lock: fingerprint: %w", err)
		}
	}
	if h.Status != 0 {
		if err := shared.CheckStatus(h.Status); err != nil {
			return fmt.Errorf("redis_lock: status: %w", err)
		}
	}
	if err := shared.CheckPrefix(h.Prefix); err != nil {
		return fmt.Errorf("redis_lock: prefix: %w", err)
	}
	if err := shared.CheckJitter(h.Jitter); err != nil {
		return fmt.Errorf("redis_lock: jitter: %w", err)
	}
	switch {
	case h.TTL < 0:
		return fmt.Errorf("redis_lock: ttl: must be positive, got %s", time.Duration(h.TTL))
	case h.TTL > 0 && time.Duration(h.TTL) < 10*time.Millisecond:
		return fmt.Errorf("redis_lock: ttl: %s is too short; use at least 10ms", time.Duration(h.TTL))
	case h.Wait != nil && *h.Wait < 0:
		return errors.New("redis_lock: wait: must not be negative")
	case h.BackoffMin < 0 || h.BackoffMax < 0:
		return errors.New("redis_lock: backoff: durations must be positive")
	case h.BackoffMin > 0 && h.BackoffMax > 0 && h.BackoffMax < h.BackoffMin:
		return fmt.Errorf("redis_lock: backoff: max %s is below min %s", time.Duration(h.BackoffMax), time.Duration(h.BackoffMin))
	case h.MaxHold < 0:
		return errors.New("redis_lock: max_hold: must not be negative")
	case h.LockDelay < 0:
		return fmt.Errorf("redis_lock: lock_delay: must not be negative, got %s", time.Duration(h.LockDelay))
	case h.Permits < 0:
		return fmt.Errorf("redis_lock: permits: must be at least 1, got %d", h.Permits)
	case h.MaxWaiters < 0:
		return fmt.Errorf("redis_lock: max_waiters: must not be negative, got %d", h.MaxWaiters)
	case h.OnLost != "" && h.OnLost != "cancel" && h.OnLost != "continue":
		return fmt.Errorf("redis_lock: on_lost: want cancel or continue, got %q", h.OnLost)
	case h.SyncReplicas < 0:
		return fmt.Errorf("redis_lock: sync_replicas: must not be negative, got %d", h.SyncReplicas)
	case h.Replay < 0:
		return errors.New("redis_lock: replay: must not be negative")
	case h.Replay > 0 && time.Duration(h.Replay) < time.Millisecond:
		return fmt.Errorf("redis_lock: replay: %v is less than 1ms, Redis's finest expiry", time.Duration(h.Replay))
	case h.ReplayMax < 0:
		return fmt.Errorf("redis_lock: replay_max: must be positive, got %d", h.ReplayMax)
	case h.ReplayMax > MaxReplayMax:
		return fmt.Errorf("redis_lock: replay_max: %v", checkReplayMax(h.ReplayMax))
	case h.Permits > 1 && len(h.Addresses) > 1:
		return fmt.Errorf("redis_lock: permits: %d permits cannot be used with a Redlock quorum of %d servers: each server counts its own holders, so holders granted by different majorities (A+B, B+C, A+C) can be more than the permits; use one Redis (a server, Cluster or Sentinel) for a semaphore", h.Permits, len(h.Addresses))
	case h.Replay > 0 && h.Permits > 1:
		return fmt.Errorf("redis_lock: replay: cannot be used with permits %d: several holders at once would each run the route, and only one answer can be replayed", h.Permits)
	case h.Replay > 0 && len(h.Keys) > 1:
		return errors.New("redis_lock: replay: takes one key template: the stored answer belongs to one lock key")
	case h.Replay > 0 && len(h.Addresses) > 1:
		return errors.New("redis_lock: replay: needs one Redis (a server, a Cluster or a Sentinel), not a Redlock quorum: an answer stored on a majority could be missed by a later majority that shares only one server with it")
	case len(h.CredentialCookies) > 0 && h.Replay == 0:
		return errors.New("redis_lock: credential_cookies: only has a meaning with replay")
	case slices.Contains(h.CredentialCookies, ""):
		return errors.New("redis_lock: credential_cookies: a cookie name must not be empty")
	case len(h.Fingerprint) > 1 && slices.Contains(h.Fingerprint, "off"):
		return errors.New("redis_lock: fingerprint: off stands alone")
	}
	if err := h.checkFencingHeader(); err != nil {
		return fmt.Errorf("redis_lock: %w", err)
	}
	return nil
}

// fencingHeaderError refuses the fencing header. sub names the template
// that reads it ("key", the keys[key]; "fingerprint"), or is "": the
// Caddyfile parser gives that subdirective's line when the refused header
// is the default (no fencing_header line).
type fencingHeaderError struct {
	msg string
	sub string
	key int
}

func (e *fencingHeaderError) Error() string { return e.msg }

// checkFencingHeader is the rule on the header the lock sets the token in
// (fencing_header, else its default): a header name, and one the lock may
// replace. Not a hop-by-hop header (a proxy drops it, so the token never
// reaches the upstream), Host or Content-Length (they route and frame the
// request), nor a header the handler reads: a key's or the fingerprint's
// placeholder, or the credentials (Authorization; under replay Cookie,
// which identifies the client by credential_cookies, or whole for a
// private answer).
func (h *RedisLock) checkFencingHeader() error {
	name, what := h.FencingHeader, fmt.Sprintf("%q", h.FencingHeader)
	if name == "" {
		name, what = DefaultFencingHeader, fmt.Sprintf("%q (the default)", DefaultFencingHeader)
	}
	refuse := func(sub string, key int, why string) error {
		return &fencingHeaderError{msg: "fencing_header: " + what + " " + why, sub: sub, key: key}
	}
	switch {
	case strings.EqualFold(name, "off"):
		return nil
	case !validHeaderName(name):
		return refuse("", 0, "is not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only)")
	case hasHeader(hopByHop, name):
		return refuse("", 0, "is a hop-by-hop header: a proxy removes it, so the token would never reach the upstream")
	case strings.EqualFold(name, "Host"):
		return refuse("", 0, "names the site the request is for; the token would replace it")
	case strings.EqualFold(name, "Content-Length"):
		return refuse("", 0, "frames the request body; the token would replace it")
	case strings.EqualFold(name, "Authorization"):
		return refuse("", 0, "carries the client's credentials; the token would replace them")
	case strings.EqualFold(name, "Cookie") && (h.Replay > 0 || len(h.CredentialCookies) > 0):
		return refuse("", 0, "identifies the client under replay (credential_cookies, or the whole header for a private answer); the token would replace it")
	}
	for i, k := range h.Keys {
		if hasHeader(shared.TemplateHeaders(k), name) {
			return refuse("key", i, fmt.Sprintf("is read by the key %q; the token would replace the client's value in it", k))
		}
	}
	for _, f := range h.Fingerprint {
		if hasHeader(shared.TemplateHeaders(f), name) {
			return refuse("fingerprint", 0, fmt.Sprintf("is read by the fingerprint %q; the token would replace the client's value in it", f))
		}
	}
	return nil
}

// hasHeader reports whether names holds name, compared as header names
// are (case-insensitively).
func hasHeader(names []string, name string) bool {
	return slices.ContainsFunc(names, func(n string) bool { return strings.EqualFold(n, name) })
}

// validHeaderName reports whether s is an HTTP field name (RFC 9110 §5.1, a
// token): one the transport to an upstream accepts.
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

// Cleanup gives back what Provision took (also after a failed Provision).
func (h *RedisLock) Cleanup() error {
	shared.UnregisterAdmin(h)
	if h.locker != nil {
		h.locker.Close()
	}
	h.obs.Release()
	for _, k := range h.poolKeys {
		shared.ReleaseClient(k)
	}
	h.poolKeys = nil
	afterResponse.unhook(h.hook)
	h.hook = nil
	return nil
}

// ServeHTTP takes the lock, calls the next handler while holding it, and
// releases it when the next handler returns (also on error or panic).
func (h *RedisLock) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	keys, display, err := h.renderKeys(repl)
	if err != nil {
		return caddyhttp.Error(http.StatusBadRequest, err)
	}

	var id identity
	if h.Replay > 0 {
		if id, err = h.identify(r, repl); err != nil {
			if errors.Is(err, errBodyTooLarge) {
				return caddyhttp.Error(http.StatusRequestEntityTooLarge, err)
			}
			return caddyhttp.Error(http.StatusBadRequest, err)
		}
	}

	start := time.Now()
	run := h.Replay > 0 && !id.safe // never twice: the run is recorded
	h.m.Waiters.Inc()
	var lease *lease
	if run {
		lease, err = h.locker.AcquireRun(r.Context(), keys, lock.Run{Fingerprint: id.fp})
	} else {
		lease, err = h.locker.Acquire(r.Context(), keys)
	}
	h.m.Waiters.Dec()
	waited := time.Since(start)
	repl.Set("http.redis_lock.key", display)
	repl.Set("http.redis_lock.wait_ms", waited.Milliseconds())

	if err != nil {
		var rp *replayed
		if errors.As(err, &rp) {
			a, why, err := h.mayServe(r, id, rp.Answer())
			switch {
			case err != nil:
				return caddyhttp.Error(http.StatusInternalServerError, err)
			case why != "":
				return h.refuseReplay(w, r, next, id, display, why)
			}
			return h.serveReplay(w, r, display, a)
		}
		if refused, err := h.runRefused(w, r, next, id, display, err); refused {
			return err
		}
		return h.acquireFailed(w, r, next, display, waited, err)
	}
	h.m.Acquired.Observe(waited.Seconds())
	return h.serveLocked(w, r, next, held{repl: repl, lease: lease, display: display, waited: waited, id: id, run: run})
}

// held is a request that got its lock.
type held struct {
	repl    *caddy.Replacer
	lease   *lease
	display string        // the rendered key, for logs and events
	waited  time.Duration // how long the request waited for the lock
	id      identity      // the request's replay identity (replay on)
	run     bool          // replay of an unsafe method: its run is recorded (never twice)
}

// acquireFailed answers a request that did not get the lock.
func (h *RedisLock) acquireFailed(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, display string, waited time.Duration, err error) error {
	var busy *busyError
	switch {
	case errors.As(err, &busy):
		h.m.Timeout.Observe(waited.Seconds())
		w.Header().Set("Retry-After", strconv.FormatInt(shared.RetryAfterSeconds(shared.Jittered(h.estimateFree(busy), h.Jitter)), 10))
		if c := h.logger.Check(zapcore.DebugLevel, "lock busy"); c != nil {
			c.Write(zap.String("key", display), zap.Duration("waited", waited), zap.Error(err))
		}
		return caddyhttp.Error(h.Status, err)
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || r.Context().Err() != nil:
		h.m.Canceled.Observe(waited.Seconds())
		return caddyhttp.Error(shared.StatusClientClosedRequest, fmt.Errorf("client went away while waiting for the lock: %w", err))
	default:
		h.m.Errored.Observe(waited.Seconds())
		if h.FailOpen {
			h.warnRedis("redis unreachable; serving without a lock (fail_open)", err)
			h.setFencingHeader(r, "")
			return next.ServeHTTP(w, r)
		}
		h.warnRedis("redis unreachable; answering 503", err)
		w.Header().Set("Retry-After", "1")
		return caddyhttp.Error(http.StatusServiceUnavailable, err)
	}
}

// warnRedis logs a Redis fault at most once a second per handler.
func (h *RedisLock) warnRedis(msg string, err error) {
	if due, n := h.warn.Due(); due {
		h.logger.Warn(msg, zap.Error(err), zap.Int64("requests_since_last_warning", n))
	}
}

func (h *RedisLock) setFencingHeader(r *http.Request, v string) {
	if strings.EqualFold(h.FencingHeader, "off") {
		return
	}
	dropConnectionOption(r.Header, h.FencingHeader)
	if v == "" {
		r.Header.Del(h.FencingHeader)
		return
	}
	r.Header.Set(h.FencingHeader, v)
}

// dropConnectionOption takes name out of the request's Connection header. A
// client that lists the fencing header there would have reverse_proxy
// remove it as hop-by-hop, and the upstream would get a locked request
// without its token.
func dropConnectionOption(hdr http.Header, name string) {
	vals, ok := hdr["Connection"]
	if !ok {
		return
	}
	var keep []string
	for _, v := range vals {
		for _, opt := range strings.Split(v, ",") {
			if opt = strings.TrimSpace(opt); opt != "" && !strings.EqualFold(opt, name) {
				keep = append(keep, opt)
			}
		}
	}
	if len(keep) == 0 {
		delete(hdr, "Connection")
		return
	}
	hdr["Connection"] = []string{strings.Join(keep, ", ")}
}

// serveLocked runs the next handler while the lease is held and kept alive.
//
// With replay, the response is recorded on its way to the client and, if it
// can be replayed, stored by the release.
func (h *RedisLock) serveLocked(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, hd held) (err error) {
	h.announceLock(r, hd)
	rw := &startedWriter{}
	// The header as handlers before the lock left it: what a replay stores
	// is what the route added, and a 503 after a lost lease goes back to it.
	switch {
	case h.Replay > 0:
		rw.before.saveCopy(w.Header())
	case h.OnLost == "cancel":
		rw.before.save(w.Header())
	}
	var rec *recorder
	base := r.Context()
	if h.Replay > 0 {
		rec = newRecorder(w, r.Context(), h.ReplayMax, rw.before.header())
		if hd.run {
			// Never twice: an answer that would start after this holder's
			// own clock says its lease ended waits until it is stored as
			// the run's own (a duplicate may have been refused meanwhile).
			rec.withhold = func() bool { return hd.lease.Valid() <= 0 }
		}
		w = rec
		// The answer outlives the client: the route runs to its end, the
		// lock held, and its answer is stored for the client's retry.
		var stopDetached context.CancelFunc
		base, stopDetached = h.detach(r.Context(), hd.lease)
		defer stopDetached()
	}
	rw.ResponseWriter = w
	var wait *responseWait // the release waits for the response (see afterresponse.go)
	if rec == nil && afterResponse.begin(r, h.hook, &rw.wait) {
		wait = &rw.wait
	}

	reqCtx, cancel := context.WithCancelCause(base)
	keep := hd.lease.Keep(lock.KeepOptions{Extend: *h.AutoExtend, MaxHold: time.Duration(h.MaxHold), OnLost: h.onLost(hd.lease.Fence(), hd.display, rw, cancel)})
	completed := false // next returned (did not panic)
	cutOff := false    // a replay route cancelled at its bound (see detach) before it returned
	defer func() {
		// Stop the extender first, so no extension can follow the release.
		keep.Stop()
		end := routeEnd{err: err, panicked: !completed, lost: rw.lost.Load(), clientGone: r.Context().Err() != nil, cutOff: cutOff}
		cancel(nil)
		if withheld := h.release(hd, r, rec, end, wait); withheld != nil && err == nil {
			rw.restoreHeader()
			w.Header().Set("Retry-After", strconv.FormatInt(shared.RetryAfterSeconds(h.inDoubtRetry(time.Duration(h.Replay))), 10))
			err = withheld
		}
		if err == nil && rw.lost.Load() && h.OnLost == "cancel" && !rw.hasStarted() {
			rw.restoreHeader()
			err = caddyhttp.Error(http.StatusServiceUnavailable, ErrLeaseLost)
		}
	}()
	func() {
		// Also when next panics (reverse_proxy aborts a copy cut short).
		defer func() { cutOff = rec != nil && errors.Is(context.Cause(base), errDetachedRunOver) }()
		// A copy aborted while the answer is withheld, or refused after a
		// lost lease, sent the client nothing: it gets 503 (see
		// releaseWithheld and on_lost), not a dropped connection.
		defer func() {
			if rec != nil && rec.withheld || rw.lost.Load() && rw.isRefused() { // refused only after lost
				if p := recover(); p != nil && p != http.ErrAbortHandler {
					panic(p)
				} else if p != nil {
					err = fmt.Errorf("the route aborted its answer: %w", context.Canceled)
				}
			}
		}()
		err = next.ServeHTTP(rw, r.WithContext(reqCtx))
	}()
	completed = true
	if err != nil && rw.lost.Load() && h.OnLost == "cancel" && !rw.hasStarted() {
		rw.restoreHeader()
		return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("%w: %v", ErrLeaseLost, err))
	}
	return err
}

// announceLock hands the fencing token to the next handler (header and
// placeholder) and logs the grant.
func (h *RedisLock) announceLock(r *http.Request, hd held) {
	fence := strconv.FormatInt(hd.lease.Fence(), 10)
	hd.repl.Set("http.redis_lock.fencing_token", fence)
	h.setFencingHeader(r, fence)
	if c := h.logger.Check(zapcore.DebugLevel, "lock acquired"); c != nil {
		c.Write(zap.String("key", hd.display), zap.Int64("fencing_token", hd.lease.Fence()), zap.Duration("waited", hd.waited))
	}
}

// onLost is what the keeper calls when the lease is found lost: it logs,
// counts and announces it, and with on_lost cancel stops the route (a
// response not started yet never starts: the client gets 503).
func (h *RedisLock) onLost(fence int64, display string, rw *startedWriter, cancel context.CancelCauseFunc) func(error) {
	return func(cause error) {
		rw.lost.Store(true)
		h.m.Lost.Inc()
		if h.LockDelay > 0 {
			h.m.DelayLost.Inc()
		}
		h.logger.Error("lock lease lost while the request ran",
			zap.String("on_lost", h.OnLost), zap.Int64("fencing_token", fence), zap.Error(cause))
		h.events.Emit(shared.EventLockLost, func() map[string]any {
			return map[string]any{"handler": h.label, "key": shared.EventKey(display), "reason": cause.Error(), "on_lost": h.OnLost}
		})
		if h.OnLost == "cancel" {
			rw.refuse()
			cancel(cause)
		}
	}
}

// routeEnd is how the route under the lock ended.
type routeEnd struct {
	err        error // what it returned
	panicked   bool  // it panicked
	lost       bool  // the lease was lost while it ran
	clientGone bool  // the client went away while it still ran
	// cutOff: a replay route whose client went away was cancelled at its
	// bound (see detach): its answer is not stored, and its upstream may
	// still be writing.
	cutOff bool
}

// release gives the lease back once the route returned (in the
// background: the answer does not wait for Redis; with wait, once the
// response is on the wire) and records the hold.
// With replay the answer is stored with it when it can be replayed; an
// answer withheld (see releaseWithheld) that could not be stored returns
// the error to answer with instead.
// Without replay, a client that went away while the route still ran
// abandons the lease: with lock_delay, nobody gets the key for the delay,
// since the upstream may still be writing.
func (h *RedisLock) release(hd held, r *http.Request, rec *recorder, end routeEnd, wait *responseWait) (withheld error) {
	switch {
	case rec != nil:
		withheld = h.releaseReplay(hd, r, rec, end)
	case end.clientGone && h.LockDelay > 0:
		if c := h.logger.Check(zapcore.DebugLevel, "lock abandoned: the client went away while the route ran; lock_delay applies"); c != nil {
			c.Write(zap.String("key", hd.display), zap.Duration("lock_delay", time.Duration(h.LockDelay)))
		}
		h.m.DelayAbandoned.Inc()
		hd.lease.Abandon()
	case wait != nil:
		// A waiter of this instance gets the lease now; a release in
		// Redis waits for the response (afterresponse.go).
		if !hd.lease.HandOffNow() {
			afterResponse.release(wait, hd.lease)
		}
	default:
		hd.lease.ReleaseInBackground("")
	}
	held := time.Since(hd.lease.Granted())
	h.m.Held.Observe(held.Seconds())
	h.holds.add(held)
	if c := h.logger.Check(zapcore.DebugLevel, "lock released"); c != nil {
		c.Write(zap.String("key", hd.display), zap.Int64("fencing_token", hd.lease.Fence()))
	}
	return withheld
}

// errDetachedRunOver ends a replay route whose client went away once the
// run outlasts its bound.
var errDetachedRunOver = errors.New("redisdlm: the client went away and the route ran past max_hold, or one ttl after the client left")

// detach returns the context a replay route runs on: it keeps the
// client's values but not its cancellation. Once the client is gone, the
// run is bounded: it ends at max_hold (from the grant) if set, else one
// ttl after the client left; it is then cancelled, and its answer is not
// stored. stop ends it when the route returns.
func (h *RedisLock) detach(client context.Context, ls *lease) (ctx context.Context, stop context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(client))
	go func() {
		select {
		case <-ctx.Done():
			return
		case <-client.Done():
		}
		bound := time.Duration(h.TTL)
		if h.MaxHold > 0 {
			bound = time.Until(ls.Granted().Add(time.Duration(h.MaxHold)))
		}
		t := time.NewTimer(max(bound, 0))
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
			cancel(errDetachedRunOver)
		}
	}()
	return ctx, func() { cancel(nil) }
}

// startedWriter records whether the response has started, and once the
// lease is lost with on_lost cancel, lets no response start any more (a
// next handler that ignores its context must not answer without the lock).
type startedWriter struct {
	caddyhttp.ResponseWriterWrapper                // in the same allocation
	before                          headerSnapshot // the header as handlers before the lock left it
	lost                            atomic.Bool    // the lease was lost while the route ran
	wait                            responseWait   // the release waiting for the response, if it does (see afterresponse.go)
	mu                              sync.Mutex
	started                         bool
	refused                         bool
}

// headerSnapshot is a header as it was at one moment. Most routes set a
// field or two before the lock (Caddy's Server): those are kept inline,
// with no copy of the map; a larger header, or a field without exactly one
// value, is cloned.
type headerSnapshot struct {
	n     int
	keys  [2]string
	vals  [2]string
	clone http.Header // the header, when it does not fit inline
}

// noHeader is the header before the lock when handlers before it set
// none: read only, never written.
var noHeader = http.Header{}

func (s *headerSnapshot) save(h http.Header) {
	if len(h) <= len(s.keys) {
		n := 0
		for k, v := range h {
			if len(v) != 1 {
				break
			}
			s.keys[n], s.vals[n] = k, v[0]
			n++
		}
		if n == len(h) {
			s.n = n
			return
		}
	}
	s.clone = h.Clone()
}

// saveCopy keeps h as a copy (what replay's recorder compares the route's
// header with: one map, cheaper than building it from the inline fields).
func (s *headerSnapshot) saveCopy(h http.Header) {
	if len(h) > 0 {
		s.clone = h.Clone()
	}
}

// header is the snapshot as a header of its own (read only when empty).
func (s *headerSnapshot) header() http.Header {
	if s.clone != nil {
		return s.clone
	}
	if s.n == 0 {
		return noHeader
	}
	h := make(http.Header, s.n)
	for i := range s.n {
		h[s.keys[i]] = []string{s.vals[i]}
	}
	return h
}

// restoreHeader puts the header back as it was before the lock: the 503 of
// a refused response carries nothing the route set without the lock (a
// session cookie, its Content-Length).
func (w *startedWriter) restoreHeader() {
	h := w.Header()
	clear(h)
	for k, v := range w.before.header() {
		h[k] = v
	}
}

// begin marks the response started; false when it may not start.
func (w *startedWriter) begin() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.refused {
		return false
	}
	w.started = true
	return true
}

// refuse lets no response start from now on (one already started goes on).
func (w *startedWriter) refuse() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.refused = !w.started
}

func (w *startedWriter) hasStarted() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.started
}

func (w *startedWriter) WriteHeader(code int) {
	if code >= 200 || code == http.StatusSwitchingProtocols {
		if !w.begin() {
			return
		}
	} else if w.isRefused() {
		return // no informational answer either
	}
	w.ResponseWriterWrapper.WriteHeader(code)
}

func (w *startedWriter) isRefused() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.refused
}

func (w *startedWriter) Write(b []byte) (int, error) {
	if !w.begin() {
		return 0, ErrLeaseLost
	}
	return w.ResponseWriterWrapper.Write(b)
}

// ReadFrom (io.Copy, file_server) starts the response too.
func (w *startedWriter) ReadFrom(r io.Reader) (int64, error) {
	if !w.begin() {
		return 0, ErrLeaseLost
	}
	return w.ResponseWriterWrapper.ReadFrom(r)
}

// FlushError (http.ResponseController's Flush, Flush before any write
// sends the header): starts the response.
func (w *startedWriter) FlushError() error {
	if !w.begin() {
		return ErrLeaseLost
	}
	return http.NewResponseController(w.ResponseWriterWrapper.ResponseWriter).Flush()
}

// Flush is http.Flusher (handlers that assert it, such as reverse_proxy's
// streaming, rather than use a ResponseController).
func (w *startedWriter) Flush() { _ = w.FlushError() }

// Unwrap is the writer it wraps (http.ResponseController reaches Hijack,
// deadlines and full duplex through it: reverse_proxy's upgrades).
func (w *startedWriter) Unwrap() http.ResponseWriter { return w.ResponseWriterWrapper.ResponseWriter }

// releaseReplay releases a replay lock, storing the holder's answer with
// the release when it can be replayed. A run (an unsafe method) whose
// answer says it did not happen or failed clears its run record; any other
// unstored outcome leaves the key in doubt (duplicates get 409).
func (h *RedisLock) releaseReplay(hd held, r *http.Request, rec *recorder, end routeEnd) error {
	ans, why := "", "the client went away and the route was cancelled at its bound (max_hold, or one ttl after the client left)"
	if !end.cutOff {
		// A run's answer is stored as its own over its run record even
		// when the lease was lost (nobody else ran: the record refused
		// them); without a run record, a lost lease stores nothing.
		ans, why = rec.answer(r, hd.id, end.err, end.panicked || end.lost && !hd.run)
	}
	if hd.run && runDidNotHappen(end, rec) {
		hd.lease.ClearRun()
	}
	if rec.withheld {
		return h.releaseWithheld(hd, rec, ans, why)
	}
	if ans == "" {
		h.m.NotStored.Inc()
		if c := h.logger.Check(zapcore.DebugLevel, "replay: response not stored"); c != nil {
			c.Write(zap.String("key", hd.display), zap.String("reason", why))
		}
		if end.cutOff && h.LockDelay > 0 {
			// Cut short with its client gone: its upstream may still
			// be writing, so lock_delay applies.
			h.m.DelayAbandoned.Inc()
			hd.lease.Abandon()
			return nil
		}
		hd.lease.ReleaseInBackground("")
		return nil
	}
	h.m.Stored.Inc()
	hd.lease.ReleaseInBackground(ans)
	return nil
}

// estimateFree estimates when a busy lock will be free for this request
// (its Retry-After, before jitter). Before this handler saw any hold, the lease's
// time left is all there is. Otherwise: the expected end of the current
// holder, its grant (Redis's TIME, so also right for a holder on another
// instance) plus the p90 of the holds seen; plus p90 for every request
// queued ahead, in this instance's queue and one per other instance in
// the key's Redis wait list; plus one timeout, the longest the holder's
// release takes to reach Redis after its answer. No cap from the lease:
// auto-extension keeps it near ttl whatever the holder does, so a cap
// would only make the figure early. A holder already past the p90 is
// beyond what the holds say of it: its lease's time left stands for it.
func (h *RedisLock) estimateFree(b *busyError) time.Duration {
	p90, ok := h.holds.p90()
	if !ok {
		return b.LeaseLeft()
	}
	held, known := b.Held()
	if !known {
		held = 0 // as if granted just now: never early
	}
	left := p90 - held
	if left <= 0 {
		left = b.LeaseLeft()
	}
	return left + p90*time.Duration(b.Ahead()+b.OthersWaiting()) + h.timeout
}

// holdTimes keeps the last hold times of a handler for its p90.
type holdTimes struct {
	mu   sync.Mutex
	ring [31]time.Duration
	n    int // holds seen
}

func (t *holdTimes) add(d time.Duration) {
	t.mu.Lock()
	t.ring[t.n%len(t.ring)] = d
	t.n++
	t.mu.Unlock()
}

// p90 of the holds kept (the 90th percentile, nearest rank); false when
// none was seen.
func (t *holdTimes) p90() (time.Duration, bool) {
	t.mu.Lock()
	n := min(t.n, len(t.ring))
	var buf [len(t.ring)]time.Duration
	copy(buf[:], t.ring[:n])
	t.mu.Unlock()
	if n == 0 {
		return 0, false
	}
	s := buf[:n]
	slices.Sort(s)
	return s[(9*n+9)/10-1], true
}

// Interface guards
var (
	_ caddy.Provisioner           = (*RedisLock)(nil)
	_ caddy.Validator             = (*RedisLock)(nil)
	_ caddy.CleanerUpper          = (*RedisLock)(nil)
	_ caddyhttp.MiddlewareHandler = (*RedisLock)(nil)
)

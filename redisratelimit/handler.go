// Package redisratelimit is the http.handlers.redis_ratelimit module and
// its Caddyfile directive: it admits or rejects a request against per-key
// limits kept in Redis, exact across every Caddy instance sharing that
// Redis, and answers the admin API for its quotas. The decisions are the
// engine's (internal/ratelimit); this package renders keys, rates and
// costs per request, answers HTTP (status, Retry-After, the RateLimit
// fields, placeholders) and reports.
package redisratelimit

import (
	_ "embed"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(RedisRateLimit{})
}

// Header names of draft-ietf-httpapi-ratelimit-headers-10, and Retry-After.
const (
	HeaderRateLimitPolicy = "RateLimit-Policy"
	HeaderRateLimit       = "RateLimit"
	HeaderRetryAfter      = "Retry-After"
)

// The header names as http.Header keys them.
var (
	canonRateLimitPolicy = http.CanonicalHeaderKey(HeaderRateLimitPolicy)
	canonRateLimit       = http.CanonicalHeaderKey(HeaderRateLimit)
)

// Defaults and limits of redis_ratelimit.
const (
	// DefaultRateLimitKey is the key template when none is given: the client
	// IP as Caddy determined it (with trusted_proxies, from the proxy headers).
	DefaultRateLimitKey = "{http.vars.client_ip}"
	// DefaultRateLimitPrefix namespaces the Redis keys of redis_ratelimit.
	DefaultRateLimitPrefix = "caddy:rl:"
	// MaxSlidingWindowRequests is the largest n of a sliding_window rate: a
	// key at its limit holds n 8-byte timestamps in Redis (about 0.9 MB
	// at this n), see README. gcra takes any n at O(1) memory.
	MaxSlidingWindowRequests = ratelimit.MaxSlidingWindowRequests

	// denyCacheSize bounds the keys one handler remembers as rejected.
	denyCacheSize = 10000
	// failWarnEvery rate-limits the warning about decisions made without Redis.
	failWarnEvery = 10 * time.Second
)

// ErrRateLimited is the error a rejected request returns to Caddy (with the
// configured status, 429 by default).
var ErrRateLimited = errors.New("redisdlm: rate limit exceeded")

// RedisRateLimit admits or rejects requests against per-key limits kept in
// one Redis (a server, a Cluster or a Sentinel group), so every Caddy
// instance sharing that Redis enforces the same limits together.
//
// Each request costs one Redis round trip (one script call for all rates,
// batched with concurrent requests into one pipeline); a key known to be
// rejected is answered from memory until it may pass again. Time is the
// Redis server's, so the clocks of the Caddy hosts do not matter.
//
// A rejected request gets `status` (429) with `Retry-After`. With `headers`
// on, every answer carries the IETF `RateLimit-Policy` and `RateLimit`
// fields. The placeholders `{http.redis_ratelimit.remaining}` and
// `{http.redis_ratelimit.retry_after}` are set for later handlers and logs.
type RedisRateLimit struct {
	// The key template: requests that render the same key share a limit.
	// Any request placeholder works, e.g. `{http.request.header.X-API-Key}`
	// or `{http.auth.user.id}`. A key that renders empty, or whose
	// placeholders are unknown for a request (e.g. `{http.auth.user.id}` with
	// no authentication before this handler, which is logged once), falls
	// back to the client IP. A placeholder outside Caddy's namespaces
	// (`http.*`, `env.*`, `time.*`, `system.*`, `file.*`) is a config error.
	// Keys longer than 200 bytes are stored as their SHA-256; keys are
	// logged at debug level only. Default: `{http.vars.client_ip}` (the
	// Caddyfile shorthand is `{client_ip}`).
	Key string `json:"key,omitempty"`

	// The rates; every one must admit a request. A rejected request is not
	// charged to any rate. A rate's n and window may be placeholders
	// (e.g. from `map` or `vars`), rendered per request, so each plan gets
	// its own limit; see Rate. A render that is not usable (an n that is
	// not base-10 digits >= 1, or above what the algorithm takes; a window
	// that is not a duration >= 1ms; an unknown placeholder; empty) is bad
	// input: the request gets 400 with a short reason, whatever the fail
	// policy, and counts nothing. So a `map` without `default` that a
	// client can steer to no value is a 400, never a free pass: give it a
	// `default`. Required: at least one.
	Rates []Rate `json:"rates,omitempty"`

	// `sliding_window` (exact: in any interval of length window, at most
	// requests are admitted, over all Caddy instances; Redis memory grows
	// with traffic, about 8–16 bytes per request admitted in the window) or
	// `gcra` (generic cell rate algorithm: O(1) memory per key, a sustained
	// requests per window with bursts up to `burst`). Default: sliding_window.
	Algorithm string `json:"algorithm,omitempty"`

	// With gcra: how many requests may pass at once, after a quiet period;
	// in any interval t at most burst + t·requests/window pass. It applies
	// to every rate. Only valid with gcra. Default: each rate's requests.
	Burst int `json:"burst,omitempty"`

	// The HTTP status of a rejected request, in 400–599; it is sent with
	// Retry-After (whole seconds, at least 1, never before the request
	// would be admitted; a local decision of fail_local gives the time to
	// the next probe of Redis instead, about a second). Default: 429.
	Status int `json:"status,omitempty"`

	// Send the RateLimit-Policy and RateLimit response fields
	// (draft-ietf-httpapi-ratelimit-headers-10) on every answer: each rate
	// is a policy named r0, r1, ... in the order given. Default: true.
	Headers *bool `json:"headers,omitempty"`

	// Decide, count (metrics, headers, placeholders) and log, but never
	// reject. A request that would be rejected is not recorded in Redis,
	// exactly as when enforcing, so a dry run shows what enforcement would
	// do. Bad input (a rate or cost that renders to no usable number) is
	// logged and counted, and passes instead of getting 400. Default: false.
	DryRun bool `json:"dry_run,omitempty"`

	// When Redis cannot be reached, answer 503 instead of admitting the
	// request. Either way a warning is logged (at most every 10s) and the
	// decision counts as `error` in the metrics. The fail policy is for
	// Redis faults only: bad input (see Rates and Cost) is a 400 either way.
	// Default: false (fail open).
	FailClosed bool `json:"fail_closed,omitempty"`

	// When Redis cannot be reached, keep enforcing every rate on this
	// instance alone, at its share: ceil(n ÷ N) per window (with gcra also
	// ceil(burst ÷ N)), where N is the number of Caddy instances sharing
	// this handler's prefix, so the fleet as a whole admits about n — never
	// every request, never none. N is counted from heartbeats each instance
	// with fail_local keeps in Redis (one per process, living 3 s; the last
	// count seen is used), or given with `instances`. A reload keeps the
	// local state (counts, pending charges, local mode). With no count ever
	// seen and no `instances`, requests get 503 as with fail_closed (logged).
	// An instance that joined within the last heartbeat (the others do not
	// count it yet, about a second after each Caddy process starts) holds
	// its requests until they do, and answers 503 if Redis goes away first;
	// so does a new key when the local limiter is full of admissions still
	// to charge.
	// The local limiter starts from this instance's own admissions of the
	// current window (kept in memory while Redis decides), and what it
	// admits is charged to Redis once Redis answers again, so neither edge
	// of an outage doubles a limit: in any window the fleet admits at most
	// Σ over instances of max(what Redis admitted through it, its share).
	// Decisions go back to Redis within about a second of it answering; for
	// a second after that the instance holds every key to its share as well
	// (the others come back and charge meanwhile). After Redis restarted
	// empty, an instance decides locally for 3 s while it charges its
	// admissions of the current windows again. A local 429's Retry-After is
	// the time to the next probe of Redis: 1 s (after a restart, until the
	// 3 s end). Local decisions count as `local` in the
	// metrics, and a warning is logged when local mode starts and ends.
	// Under local mode `wait` holds nothing and `count` counts every
	// admitted answer. Not with fail_closed. Default: false (fail open).
	FailLocal bool `json:"fail_local,omitempty"`

	// With fail_local: the number of Caddy instances N that share this
	// limit, instead of the count from heartbeats; each instance enforces
	// ceil(n ÷ N) while Redis is unreachable. At least 1; only with
	// fail_local. Default: 0 (counted from heartbeats).
	Instances int `json:"instances,omitempty"`

	// The namespace of this handler's Redis keys. Limits with the same
	// prefix, key and rate share their state (also across routes and
	// sites); give a limit its own prefix to keep it apart. Must not
	// contain `{` or `}`. Default: `caddy:rl:`.
	Prefix string `json:"prefix,omitempty"`

	// Raise Retry-After by a random share of it, up to this fraction (0.2:
	// up to 20% later), so rejected clients do not all come back at the
	// same moment. Never lowers it; applied before rounding up to whole
	// seconds. RateLimit's t= is not jittered. Between 0 and 1. Default: 0.
	Jitter float64 `json:"jitter,omitempty"`

	// Group client IPs by network prefix wherever the client IP is in the
	// key (the default key, the fallback of a key that renders empty, and
	// {client_ip} in a template): [IPv4 bits, IPv6 bits], e.g. [24, 64], so
	// one host with many addresses shares one bucket. IPv4-mapped IPv6
	// counts as IPv4, zones are dropped, and a client address that is no IP
	// is used as it is. 0 bits is an error (every client would share one
	// bucket). Default: [32, 128] (every address on its own).
	IPPrefix []int `json:"ip_prefix,omitempty"`

	// How the admin API (admin.api.redisdlm) names this handler: its
	// quotas are at /redisdlm/limits/<name>/<key>. Letters, digits, `-`,
	// `_` and `.`, not all digits; unique among the redis_ratelimit
	// handlers of one config. It is also the handler label of its metrics,
	// log lines and events. Default: none (the handler is addressed by its
	// position in the admin API's list, and labelled "rl-" and a short hash
	// of its config).
	Name string `json:"name,omitempty"`
	// What one request counts for against every rate: a whole number of at
	// least 1, or a placeholder rendered per request (e.g. one that `map`
	// sets per endpoint). The RateLimit fields and Retry-After are in these
	// units. A request that costs more than a rate's requests (with gcra:
	// its burst) can never pass and is rejected at once, without Retry-After.
	// A usable rendered cost is base-10 digits and nothing else, at least 1
	// and within 64 bits: no sign, exponent, fraction or surrounding spaces
	// (the render is never trimmed), so `0`, `-1`, `+5`, `1e3`, `5.0`, ` 5`
	// and empty are not. Any other render is bad input: the request gets 400
	// with a short reason (never the fail policy: not admitted, not 503),
	// counts nothing in Redis, counts as `bad_request` in the metrics, and is
	// logged once per template; under dry_run it passes. In JSON a number or
	// a string. Default: 1.
	Cost IntOrPlaceholder `json:"cost,omitempty"`

	// Count only answers with these statuses: codes (`401`) or classes
	// (`5xx`), each in 100-599. A request is admitted while the count is
	// below the limit and holds a reservation while it runs; the
	// reservation stays when its answer is listed, and is returned (a
	// second Redis call) when it is not. So, over every instance, at most
	// the limit of counted answers fall in any window, however many
	// requests run at once. A request whose client went away before an
	// answer keeps its reservation. Default: every answer counts.
	Count []string `json:"count,omitempty"`

	// Hold a request that would be rejected, but would be admitted within
	// this long, until its moment, instead of rejecting it: each held
	// request reserves its future slot in the same script call, so held
	// requests pass one by one at the limit's pace, with no polling. A
	// client that goes away stops waiting at once and its slot is
	// returned. Requests beyond what `wait` can absorb are rejected at once.
	// Ignored with dry_run. The time held is in the histogram
	// caddy_redis_ratelimit_waited_seconds. Default: 0 (reject at once).
	Wait caddy.Duration `json:"wait,omitempty"`

	// Ban a key its quota rejects for this long: a penalty box for
	// credential stuffing and scrapers. Once a rate rejects a request of a
	// key, every request of that key is rejected outright until the ban
	// ends, on every rate and on every Caddy instance sharing the Redis,
	// with Retry-After at the ban's end; requests refused by the ban count
	// as `banned` in caddy_redis_ratelimit_requests_total, and the event
	// `rate_limit_banned` announces the ban once, when it starts. The ban is
	// kept in Redis next to the key's rates (set by the decision that
	// rejects, checked first by every decision; it expires when it ends),
	// announced to every instance as it starts, and each instance answers
	// a ban it has seen from memory until its end, also while Redis is
	// unreachable, whatever the fail policy, and across a reconnect to
	// Redis (after one to a restarted Redis it writes the ban back). The
	// admin API shows it (`banned_until`) and its DELETE lifts it with the
	// quota, on every instance within a second. Bad input, a cost
	// above a rate's capacity, dry_run, and requests that `wait` holds and
	// admits never ban (a request `wait` cannot absorb does). At least 1ms.
	// Default: 0 (no ban).
	Ban caddy.Duration `json:"ban,omitempty"`

	// The connection to Redis: one logical Redis (one `redis` address, a
	// `cluster` or a `sentinel`).
	shared.RedisConfig

	// runtime state
	logger    *zap.Logger
	label     string // the name, else a short hash of the JSON config
	events    shared.Emitter
	keyTmpl   *shared.KeyTemplate
	algo      ratelimit.Algorithm
	limit     *ratelimit.Limit // the engine's: its keys and scripts
	specs     []rateSpec       // the rates as configured
	static    plan             // the plan of every request without placeholders
	dynamic   bool             // some rate's n or window is a placeholder
	costTmpl  string
	counts    *statusSet // nil: every answer counts
	status    int
	sendHdrs  bool
	counters  [len(shared.RateLimitResults)]prometheus.Counter // by result, as rateLimitResults
	waited    prometheus.Observer
	obs       *shared.LabelClaim
	timeout   time.Duration
	client    *shared.Client
	clientKey string
	deny      *ratelimit.DenyCache
	// announced: the keys whose rate_limit_exceeded went out, until the
	// moment the rejection named (a DenyCache used as a set of keys that
	// expire): one event per key per period, also where deny keeps no
	// rejection (count, wait, a log's order).
	announced  *ratelimit.DenyCache
	fleet      *fleet           // fail_local; nil without
	local      *localState      // fail_local; nil without (shared: localPool)
	localKey   string           // of local in localPool, once acquired
	seen       *checkSeen       // fail_local: the restarts of client's check local answered
	now        func() time.Time // local monotonic clock, only for the deny cache
	warn       *shared.Warnings
	settleWarn *shared.Warnings
	fullWarn   *shared.Warnings // fail_local: a new key finds its limiter full
}

// rateSpec is one rate as configured: n and window, or the placeholders
// they come from (rendered per request; the plan of a request without
// them has stand-ins, n 1 per second).
type rateSpec struct {
	n      int64
	window time.Duration
	name   string // `"r<i>";r=`, the start of its RateLimit field
	reason string // "rate r<i> exceeded", for the events of a rejection
	nTmpl  string // the placeholder n comes from, if any
	wTmpl  string // the placeholder window comes from, if any
}

// CaddyModule returns the Caddy module information.
func (RedisRateLimit) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.redis_ratelimit",
		New: func() caddy.Module { return new(RedisRateLimit) },
	}
}

// Provision sets defaults, checks the config and gets the shared Redis
// client. It never dials Redis.
func (h *RedisRateLimit) Provision(ctx caddy.Context) error {
	h.label = shared.HandlerLabel("rl", h.Name, h)
	h.logger = ctx.Logger().With(zap.String("handler", h.label))
	h.events = shared.NewEmitter(ctx)
	h.warn = shared.NewWarnings(failWarnEvery)
	h.settleWarn = shared.NewWarnings(failWarnEvery)
	h.fullWarn = shared.NewWarnings(failWarnEvery)
	if h.now == nil {
		h.now = time.Now
	}
	keyRaw := h.Key
	if keyRaw == "" {
		keyRaw = DefaultRateLimitKey
	}
	h.status = h.Status
	if h.status == 0 {
		h.status = http.StatusTooManyRequests
	}
	h.sendHdrs = h.Headers == nil || *h.Headers
	if h.Prefix == "" {
		h.Prefix = DefaultRateLimitPrefix
	}
	if err := h.Validate(); err != nil {
		return err
	}
	if err := shared.RegisterMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}

	var err error
	if h.client, h.clientKey, h.timeout, err = h.RedisConfig.AcquireOne("redis_ratelimit"); err != nil {
		return err
	}

	h.algo, _ = ratelimit.AlgorithmNamed(h.Algorithm) // checked by Validate
	h.specs = make([]rateSpec, len(h.Rates))
	rates := make([]ratelimit.Rate, len(h.Rates))
	for i, r := range h.Rates {
		s := rateSpec{n: int64(r.Requests), window: time.Duration(r.Window), name: fmt.Sprintf(`"r%d";r=`, i), reason: fmt.Sprintf("rate r%d exceeded", i)}
		s.nTmpl, s.wTmpl = shared.ExpandShorthands(r.requestsTmpl), shared.ExpandShorthands(r.windowTmpl)
		if s.nTmpl != "" {
			s.n = 1 // a stand-in until a request renders it
		}
		if s.wTmpl != "" {
			s.window = time.Second
		}
		h.dynamic = h.dynamic || s.nTmpl != "" || s.wTmpl != ""
		h.specs[i], rates[i] = s, h.rate(s.n, s.window)
	}
	cost := int64(1)
	if c := string(h.Cost); redisconn.HasPlaceholder(c) {
		h.costTmpl = shared.ExpandShorthands(c)
	} else if c != "" {
		cost, _ = strconv.ParseInt(c, 10, 64) // checked by Validate
	}
	h.counts, _ = parseStatusSet(h.Count) // checked by Validate
	h.limit = ratelimit.NewLimit(h.Prefix, h.algo, ratelimit.LimitOptions{
		Ban: h.ban(), Hold: h.hold(), Returns: h.counts != nil || h.Wait > 0, Indexed: h.dynamic,
	})
	h.static = h.newPlan(rates, cost)
	if h.keyTmpl, err = shared.ParseKeyTemplate(keyRaw); err != nil {
		return fmt.Errorf("redis_ratelimit: key: %w", err)
	}
	if len(h.IPPrefix) == 2 {
		h.keyTmpl.IP = shared.IPPrefix{V4: h.IPPrefix[0], V6: h.IPPrefix[1]}
	}
	series := shared.NewRateLimitSeries(h.label)
	h.counters, h.waited = series.Results, series.Waited
	h.obs = shared.ObserveHandler("rl", h.label, h.logger, h.client)
	if h.counts == nil || h.Ban > 0 {
		// With count, it holds bans only (see remember).
		h.deny = h.newDenyCache()
	}
	h.announced = h.newDenyCache()
	if err := shared.RegisterAdmin(ctx, h, &h.RedisConfig); err != nil {
		return err
	}
	if h.FailLocal {
		if err := h.acquireLocal(); err != nil {
			return err
		}
	}
	registerResets(h)
	h.startFleet(ctx)
	return nil
}

// newDenyCache makes the handler's deny cache, on its clock.
func (h *RedisRateLimit) newDenyCache() *ratelimit.DenyCache {
	return ratelimit.NewDenyCache(denyCacheSize, ratelimit.ClockFunc(h.now))
}

// Validate checks the config; it repeats what the Caddyfile parser checks,
// because JSON configs never pass through it.
func (h *RedisRateLimit) Validate() error {
	if err := h.RedisConfig.Validate(false); err != nil {
		return fmt.Errorf("redis_ratelimit: %w", err)
	}
	key := h.Key
	if key == "" {
		key = DefaultRateLimitKey
	}
	if err := shared.CheckKeyTemplate(key); err != nil {
		return fmt.Errorf("redis_ratelimit: key: %w", err)
	}
	if len(h.Rates) == 0 {
		return errors.New("redis_ratelimit: rate: at least one rate is required")
	}
	if err := checkAlgorithm(h.Algorithm); err != nil {
		return fmt.Errorf("redis_ratelimit: algorithm: %w", err)
	}
	algo, _ := ratelimit.AlgorithmNamed(h.Algorithm)
	for i, r := range h.Rates {
		if err := checkRate(r, algo); err != nil {
			return fmt.Errorf("redis_ratelimit: rate %d: %w", i, err)
		}
	}
	for _, c := range []struct {
		sub string
		err error
	}{
		{"burst", checkBurst(h.Burst, algo)},
		{"cost", checkCost(string(h.Cost))},
		{"count", checkCount(h.Count)},
		{"wait", checkWait(time.Duration(h.Wait))},
		{"ban", checkBan(time.Duration(h.Ban))},
		{"fail_local", checkFailPolicy(h.FailLocal, h.FailClosed)},
		{"instances", checkInstances(h.Instances, h.FailLocal)},
		{"ip_prefix", checkIPPrefix(h.IPPrefix)},
		{"jitter", shared.CheckJitter(h.Jitter)},
		{"prefix", shared.CheckPrefix(h.Prefix)},
	} {
		if c.err != nil {
			return fmt.Errorf("redis_ratelimit: %s: %w", c.sub, c.err)
		}
	}
	if h.Status != 0 {
		if err := shared.CheckStatus(h.Status); err != nil {
			return fmt.Errorf("redis_ratelimit: status: %w", err)
		}
	}
	return nil
}

// Cleanup releases the shared client of this handler (only what Provision
// acquired).
func (h *RedisRateLimit) Cleanup() error {
	shared.UnregisterAdmin(h)
	unregisterResets(h)
	h.obs.Release()
	h.releaseLocal()
	shared.ReleaseClient(h.clientKey)
	h.clientKey = ""
	return nil
}

// ServeHTTP decides the request and either passes it on (at once, or
// held until its slot with wait) or rejects it.
func (h *RedisRateLimit) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	p, err := h.planFor(repl)
	if err != nil {
		return h.badInput(w, r, next, err)
	}
	id := h.limitID(r, repl)

	if h.counts != nil || h.Wait > 0 {
		// An admission may be returned when the request ends (count, a
		// held client that leaves): the client stays open until then,
		// also across a reload.
		h.client.Conn.Use()
		defer h.client.Conn.Unuse()
	}
	d, err := h.decide(r.Context(), id, p)
	if err != nil {
		if ctxErr := r.Context().Err(); ctxErr != nil {
			// The client went away: nobody reads an answer.
			return caddyhttp.Error(statusClientClosedRequest, fmt.Errorf("client went away during the rate-limit decision: %w", ctxErr))
		}
		return h.failPolicy(w, r, next, p, id, err)
	}

	retry := int64(0)
	if !d.Allowed && d.Wait > 0 {
		retry = shared.RetryAfterSeconds(shared.Jittered(d.Wait, h.Jitter))
	}
	if h.sendHdrs {
		h.setHeaders(r, w.Header(), p, d)
	}
	repl.Set("http.redis_ratelimit.remaining", d.Remaining)
	repl.Set("http.redis_ratelimit.retry_after", retry)
	h.report(id, p, d, retry)
	if !d.Allowed && !h.DryRun {
		if retry > 0 {
			w.Header().Set(HeaderRetryAfter, strconv.FormatInt(retry, 10))
		}
		return caddyhttp.Error(h.status, ErrRateLimited)
	}
	if !d.Allowed { // dry run: nothing recorded, nothing to settle
		return next.ServeHTTP(w, r)
	}
	if h.Wait > 0 && !h.DryRun {
		if err := h.holdFor(r, id, p, d); err != nil {
			return err
		}
	}
	if h.counts == nil {
		return next.ServeHTTP(w, r)
	}
	return h.serveCounted(w, r, next, id, p, d)
}

// report counts a decision in the metrics (a request refused by a ban as
// banned), announces a rejection (rate_limit_exceeded at most once per key
// per deny-cache period, rate_limit_banned once, as the ban starts), and
// logs it at debug level.
func (h *RedisRateLimit) report(id string, p *plan, d decision, retry int64) {
	switch {
	case d.Allowed:
		h.counters[shared.ResultAllowed].Inc()
	case d.Ban == ratelimit.Banned:
		h.counters[shared.ResultBanned].Inc()
	default:
		h.counters[shared.ResultDenied].Inc()
		reason := h.specs[d.Tight].reason
		if !d.Cached && h.firstRejection(id, d) { // at most once per key per deny-cache period
			h.events.Emit(shared.EventRateLimitExceeded, func() map[string]any {
				return map[string]any{"handler": h.label, "key": id, "reason": reason, "retry_after": retry, "dry_run": h.DryRun}
			})
		}
		if d.Ban == ratelimit.BanStarted {
			h.events.Emit(shared.EventRateLimitBanned, func() map[string]any {
				return map[string]any{"handler": h.label, "key": id, "reason": reason, "retry_after": retry, "ban": h.ban().String()}
			})
		}
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision"); c != nil {
		c.Write(zap.String("key", id), zap.Bool("allowed", d.Allowed), zap.Int64("remaining", d.Remaining),
			zap.Int64("retry_after", retry), zap.Duration("hold", d.Hold), zap.Int64("cost", p.Cost),
			zap.Bool("dry_run", h.DryRun), zap.Bool("deny_cache", d.Cached), zap.Bool("banned", d.Ban != ratelimit.NotBanned))
	}
}

// firstRejection reports whether a rejection of id, answered by Redis, is
// the first of its period for the key (until the moment it names, at least
// a second): concurrent rejections, and those of other plans and costs, or
// that the deny cache does not keep (count, wait, a log's order), all reach
// Redis. The rejection that starts a ban is always announced.
func (h *RedisRateLimit) firstRejection(id string, d decision) bool {
	if h.announced == nil {
		return true
	}
	return h.announced.Mark(id, h.now().Add(max(d.Wait, time.Second))) || d.Ban == ratelimit.BanStarted
}

// holdFor holds an admitted request until its slot (wait); a client that
// goes away meanwhile gets its admission returned.
func (h *RedisRateLimit) holdFor(r *http.Request, id string, p *plan, d decision) error {
	if d.Hold > 0 {
		t := time.NewTimer(d.Hold)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			h.settle(id, p, d)
			return caddyhttp.Error(statusClientClosedRequest, fmt.Errorf("client went away while held for its rate-limit slot: %w", r.Context().Err()))
		}
	}
	h.waited.Observe(d.Hold.Seconds())
	return nil
}

// serveCounted runs the rest of the route for an admission under count,
// and returns the admission when the answer's status does not count.
func (h *RedisRateLimit) serveCounted(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, id string, p *plan, d decision) error {
	rec := caddyhttp.NewResponseRecorder(w, nil, nil)
	err := next.ServeHTTP(rec, r)
	status := rec.Status()
	if err != nil {
		var he caddyhttp.HandlerError
		if errors.As(err, &he) {
			status = he.StatusCode
		} else if status == 0 {
			status = http.StatusInternalServerError
		}
	}
	if status == 0 {
		status = http.StatusOK // nothing written: Caddy answers 200
	}
	if status != statusClientClosedRequest && !h.counts.has(status) {
		h.settle(id, p, d)
	}
	return err
}

// setHeaders sets the RateLimit-Policy and RateLimit fields of an answer.
func (h *RedisRateLimit) setHeaders(r *http.Request, hdr http.Header, p *plan, d decision) {
	name, window := h.specs[d.Tight].name, p.Rates[d.Tight].Window
	// Seconds until the quota grows: within the window, but under a ban
	// not before the ban ends.
	until := d.Reset
	if d.Ban == ratelimit.NotBanned {
		until = min(until, window)
	}
	reset := shared.CeilSeconds(until)
	defer caddyhttp.SetVar(r.Context(), stackVar, h)
	if prev, ok := caddyhttp.GetVar(r.Context(), stackVar).(*RedisRateLimit); ok && prev != h {
		rl := name + strconv.FormatInt(d.Remaining, 10) + ";t=" + strconv.FormatInt(reset, 10)
		stackHeaders(hdr, prev.label, h.label, p.policy, rl)
		return
	}
	// Both fields in one allocation, under their canonical names (as
	// Header.Set would store them). The quota grows within the window.
	var buf [64]byte
	f := append(buf[:0], name...)
	f = strconv.AppendInt(f, d.Remaining, 10)
	f = append(f, ";t="...)
	f = strconv.AppendInt(f, reset, 10)
	vals := []string{p.policy, string(f)}
	hdr[canonRateLimitPolicy] = vals[0:1:1]
	hdr[canonRateLimit] = vals[1:2:2]
}

// Interface guards
var (
	_ caddy.Provisioner           = (*RedisRateLimit)(nil)
	_ caddy.Validator             = (*RedisRateLimit)(nil)
	_ caddy.CleanerUpper          = (*RedisRateLimit)(nil)
	_ caddyhttp.MiddlewareHandler = (*RedisRateLimit)(nil)
)

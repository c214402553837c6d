package redisdlm

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
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
	MaxSlidingWindowRequests = 100000

	algoSliding = "sliding_window"
	algoGCRA    = "gcra"

	// denyCacheSize bounds the keys one handler remembers as rejected.
	denyCacheSize = 10000
	// failWarnEvery rate-limits the warning about decisions made without Redis.
	failWarnEvery = 10 * time.Second
)

var (
	//go:embed scripts/ratelimit_sliding.lua
	slidingLua string
	//go:embed scripts/ratelimit_gcra.lua
	gcraLua string

	slidingScript = redis.NewScript(slidingLua)
	gcraScript    = redis.NewScript(gcraLua)
)

// ErrRateLimited is the error a rejected request returns to Caddy (with the
// configured status, 429 by default).
var ErrRateLimited = errors.New("redisdlm: rate limit exceeded")

// Rate is one limit: at most Requests requests per Window.
type Rate struct {
	// The number of requests admitted per window. Required; at least 1.
	// With sliding_window at most 100000.
	Requests int `json:"requests"`

	// The length of the window. Required; at least 1ms.
	Window caddy.Duration `json:"window"`
}

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
	// charged to any rate. Required: at least one.
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
	// would be admitted). Default: 429.
	Status int `json:"status,omitempty"`

	// Send the RateLimit-Policy and RateLimit response fields
	// (draft-ietf-httpapi-ratelimit-headers-10) on every answer: each rate
	// is a policy named r0, r1, ... in the order given. Default: true.
	Headers *bool `json:"headers,omitempty"`

	// Decide, count (metrics, headers, placeholders) and log, but never
	// reject. A request that would be rejected is not recorded in Redis,
	// exactly as when enforcing, so a dry run shows what enforcement would
	// do. Default: false.
	DryRun bool `json:"dry_run,omitempty"`

	// When Redis cannot be reached, answer 503 instead of admitting the
	// request. Either way a warning is logged (at most every 10s) and the
	// decision counts as `error` in the metrics. Default: false (fail open).
	FailClosed bool `json:"fail_closed,omitempty"`

	// The namespace of this handler's Redis keys. Limits with the same
	// prefix, key and rate share their state (also across routes and
	// sites); give a limit its own prefix to keep it apart. Must not
	// contain `{` or `}`. Default: `caddy:rl:`.
	Prefix string `json:"prefix,omitempty"`

	// How the admin API (admin.api.redisdlm) names this handler: its
	// quotas are at /redisdlm/limits/<name>/<key>. Letters, digits, `-`,
	// `_` and `.`, not all digits; unique among the redis_ratelimit
	// handlers of one config. Default: none (the handler is addressed by
	// its position in the admin API's list).
	Name string `json:"name,omitempty"`

	// The connection to Redis: one logical Redis (one `redis` address, a
	// `cluster` or a `sentinel`).
	RedisConfig

	// runtime state
	logger    *zap.Logger
	keyTmpl   *keyTemplate
	keyHead   string // Prefix + "{": a Redis key is keyHead + id + a rate's tail
	rates     []rateSpec
	script    *redis.Script
	argv      []any // the script's arguments: every rate's n, window (and burst)
	algo      string
	status    int
	sendHdrs  bool
	policy    string                // the RateLimit-Policy value
	counters  [3]prometheus.Counter // decisions: allowed, denied, error
	timeout   time.Duration
	client    *pooledClient
	clientKey string
	deny      *denyCache
	now       func() time.Time // local monotonic clock, only for the deny cache
	warn      *warnings
}

// rateSpec is one rate as the script takes it.
type rateSpec struct {
	n      int64
	window time.Duration
	burst  int64
	suffix string // of the Redis key
	tail   string // "}" + suffix: closes the hash tag
	name   string // `"r<i>";r=`, the start of its RateLimit field
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
	h.logger = ctx.Logger()
	h.warn = newWarnings(failWarnEvery)
	if h.now == nil {
		h.now = time.Now
	}
	keyRaw := h.Key
	if keyRaw == "" {
		keyRaw = DefaultRateLimitKey
	}
	h.algo = h.Algorithm
	if h.algo == "" {
		h.algo = algoSliding
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
	if err := registerMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}

	servers, err := h.RedisConfig.resolve()
	if err != nil {
		return fmt.Errorf("redis_ratelimit: %w", err)
	}
	if len(servers) != 1 {
		return fmt.Errorf("redis_ratelimit: redis: %d servers given, but this handler takes exactly one logical Redis", len(servers))
	}
	pc, key, err := acquireClient(servers[0])
	if err != nil {
		return fmt.Errorf("redis_ratelimit: loading redis client: %w", err)
	}
	h.client, h.clientKey = pc, key
	h.timeout = servers[0].Timeout

	h.script = slidingScript
	if h.algo == algoGCRA {
		h.script = gcraScript
	}
	h.rates = make([]rateSpec, len(h.Rates))
	policies := make([]string, len(h.Rates))
	for i, r := range h.Rates {
		s := rateSpec{n: int64(r.Requests), window: time.Duration(r.Window)}
		if h.algo == algoGCRA {
			s.burst = s.n
			if h.Burst > 0 {
				s.burst = int64(h.Burst)
			}
			s.suffix = fmt.Sprintf(":gcra:%d/%s:b%d", s.n, s.window, s.burst)
		} else {
			s.suffix = fmt.Sprintf(":sw:%d/%s", s.n, s.window)
		}
		s.tail = "}" + s.suffix
		s.name = fmt.Sprintf(`"r%d";r=`, i)
		h.rates[i] = s
		policies[i] = fmt.Sprintf(`"r%d";q=%d;w=%d`, i, s.n, ceilSeconds(s.window))
	}
	h.policy = strings.Join(policies, ", ")
	h.keyHead = h.Prefix + "{"
	if h.keyTmpl, err = parseKeyTemplate(keyRaw); err != nil {
		return fmt.Errorf("redis_ratelimit: key: %w", err)
	}
	for _, s := range h.rates {
		h.argv = append(h.argv, s.n, s.window.Microseconds())
		if h.algo == algoGCRA {
			h.argv = append(h.argv, s.burst)
		}
	}
	for i, result := range []string{"allowed", "denied", "error"} {
		h.counters[i] = rateLimitTotal.WithLabelValues(result)
	}
	h.deny = newDenyCache(denyCacheSize)
	return adminRegister(ctx, h)
}

// Validate checks the config; it repeats what the Caddyfile parser checks,
// because JSON configs never pass through it.
func (h *RedisRateLimit) Validate() error {
	if err := h.RedisConfig.validate(false); err != nil {
		return fmt.Errorf("redis_ratelimit: %w", err)
	}
	key := h.Key
	if key == "" {
		key = DefaultRateLimitKey
	}
	if err := checkKeyTemplate(key); err != nil {
		return fmt.Errorf("redis_ratelimit: key: %w", err)
	}
	if len(h.Rates) == 0 {
		return errors.New("redis_ratelimit: rate: at least one rate is required")
	}
	algo := h.Algorithm
	if algo == "" {
		algo = algoSliding
	}
	if algo != algoSliding && algo != algoGCRA {
		return fmt.Errorf("redis_ratelimit: algorithm: want sliding_window or gcra, got %q", h.Algorithm)
	}
	for i, r := range h.Rates {
		if err := checkRate(r.Requests, time.Duration(r.Window), algo); err != nil {
			return fmt.Errorf("redis_ratelimit: rate %d: %w", i, err)
		}
	}
	if h.Burst < 0 || h.Burst != 0 && algo != algoGCRA {
		if h.Burst < 0 {
			return fmt.Errorf("redis_ratelimit: burst: must be positive, got %d", h.Burst)
		}
		return errors.New("redis_ratelimit: burst: only valid with algorithm gcra")
	}
	if h.Status != 0 && (h.Status < 400 || h.Status > 599) {
		return fmt.Errorf("redis_ratelimit: status: want an HTTP status code in 400-599, got %d", h.Status)
	}
	if strings.ContainsAny(h.Prefix, "{}") {
		return fmt.Errorf("redis_ratelimit: prefix: must not contain { or } (the handler adds the hash tag), got %q", h.Prefix)
	}
	return nil
}

// checkRate checks one rate; the Caddyfile parser uses it too.
func checkRate(n int, window time.Duration, algo string) error {
	if n < 1 {
		return fmt.Errorf("requests must be at least 1, got %d", n)
	}
	if window < time.Millisecond {
		return fmt.Errorf("window must be at least 1ms, got %s", window)
	}
	if algo == algoSliding && n > MaxSlidingWindowRequests {
		return fmt.Errorf("%d requests is more than sliding_window accepts (%d): it keeps one 8-byte timestamp per admitted request per key in Redis; use algorithm gcra for larger rates", n, MaxSlidingWindowRequests)
	}
	if algo == algoGCRA && int64(window/time.Microsecond) < int64(n) {
		return fmt.Errorf("%d requests per %s is faster than gcra's resolution of one request per microsecond", n, window)
	}
	return nil
}

// Cleanup releases the shared client of this handler (only what Provision
// acquired).
func (h *RedisRateLimit) Cleanup() error {
	adminUnregister(h)
	releaseClient(h.clientKey)
	h.clientKey = ""
	return nil
}

// decision is the outcome for one request.
type decision struct {
	allowed   bool
	wait      time.Duration // until the request would be admitted (0 when admitted)
	tight     int           // the rate reported in the RateLimit field
	remaining int64         // of rate tight
	reset     time.Duration // until rate tight's quota grows (0 = full)
	cached    bool          // answered from the deny cache
}

// ServeHTTP decides the request and either passes it on or rejects it.
func (h *RedisRateLimit) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	id := h.limitID(r, repl)

	d, err := h.decide(r.Context(), id)
	if err != nil {
		if ctxErr := r.Context().Err(); ctxErr != nil {
			return ctxErr // the client went away: nobody reads an answer
		}
		return h.failPolicy(w, r, next, repl, err)
	}

	retry := int64(0)
	if !d.allowed {
		retry = retryAfterSeconds(d.wait)
	}
	if h.sendHdrs {
		// Both fields in one allocation, under their canonical names (as
		// Header.Set would store them).
		var buf [64]byte
		f := append(buf[:0], h.rates[d.tight].name...)
		f = strconv.AppendInt(f, d.remaining, 10)
		f = append(f, ";t="...)
		f = strconv.AppendInt(f, ceilSeconds(d.reset), 10)
		vals := []string{h.policy, string(f)}
		hdr := w.Header()
		hdr[canonRateLimitPolicy] = vals[0:1:1]
		hdr[canonRateLimit] = vals[1:2:2]
	}
	repl.Set("http.redis_ratelimit.remaining", d.remaining)
	repl.Set("http.redis_ratelimit.retry_after", retry)
	if d.allowed {
		h.counters[0].Inc()
	} else {
		h.counters[1].Inc()
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision"); c != nil {
		c.Write(zap.String("key", id), zap.Bool("allowed", d.allowed), zap.Int64("remaining", d.remaining),
			zap.Int64("retry_after", retry), zap.Bool("dry_run", h.DryRun), zap.Bool("deny_cache", d.cached))
	}
	if d.allowed || h.DryRun {
		return next.ServeHTTP(w, r)
	}
	w.Header().Set(HeaderRetryAfter, strconv.FormatInt(retry, 10))
	return caddyhttp.Error(h.status, ErrRateLimited)
}

// decide answers from the deny cache, else asks Redis (one script call).
func (h *RedisRateLimit) decide(ctx context.Context, id string) (decision, error) {
	if e, ok := h.deny.get(id, h.now()); ok {
		return decision{tight: e.tight, wait: e.retryAt.Sub(h.now()), reset: e.retryAt.Sub(h.now()), cached: true}, nil
	}
	c := &rlCall{script: h.script, argv: h.argv}
	var keys [4]string
	c.keys = keys[:0]
	for _, s := range h.rates {
		c.keys = append(c.keys, h.keyHead+id+s.tail)
	}
	sent := h.now()
	res, err := h.client.rateLimit(ctx, c, h.logger)
	got := h.now()
	if err != nil {
		return decision{}, err
	}
	d, err := parseDecision(res, len(h.rates))
	if err != nil {
		return decision{}, err
	}
	if !d.allowed {
		// The script ran after sent and before got, so the request passes
		// no earlier than sent+wait (the cache holds until shortly before
		// that, minus a margin for clock-rate differences) and surely by
		// got+wait (what Retry-After reports from the cache).
		margin := time.Millisecond + d.wait/1000
		h.deny.put(id, denyEntry{until: sent.Add(d.wait - margin), retryAt: got.Add(d.wait), tight: d.tight}, got)
	}
	return d, nil
}

// parseDecision reads the script's answer.
func parseDecision(res any, nrates int) (decision, error) {
	vals, ok := res.([]any)
	if !ok || len(vals) != 2+2*nrates {
		return decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v", res)
	}
	num := make([]int64, len(vals))
	for i, v := range vals {
		n, ok := v.(int64)
		if !ok {
			return decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v", res)
		}
		num[i] = n
	}
	d := decision{allowed: num[0] == 1, wait: time.Duration(num[1]) * time.Microsecond, tight: -1}
	// The tightest rate: the least remaining, then the longest until it grows.
	for i := 0; i < nrates; i++ {
		rem, reset := num[2+2*i], time.Duration(num[3+2*i])*time.Microsecond
		if d.tight < 0 || rem < d.remaining || rem == d.remaining && reset > d.reset {
			d.tight, d.remaining, d.reset = i, rem, reset
		}
	}
	return d, nil
}

// failPolicy answers when Redis could not decide.
func (h *RedisRateLimit) failPolicy(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, repl *caddy.Replacer, err error) error {
	h.counters[2].Inc()
	h.warnFail(err)
	if h.sendHdrs {
		w.Header().Set(HeaderRateLimitPolicy, h.policy)
	}
	if h.FailClosed {
		return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("redis_ratelimit: no decision from redis: %w", err))
	}
	return next.ServeHTTP(w, r)
}

// warnFail logs decisions made without Redis at most every failWarnEvery.
func (h *RedisRateLimit) warnFail(err error) {
	due, n := h.warn.due()
	if !due {
		return
	}
	policy := "admitting requests (fail open)"
	if h.FailClosed {
		policy = "rejecting requests with 503 (fail_closed)"
	}
	h.logger.Warn("redis unavailable for rate limiting; "+policy,
		zap.String("redis", h.client.settings.display()),
		zap.Error(err),
		zap.Int64("decisions_since_last_warning", n))
}

// denyCache remembers keys rejected until a moment, so they are answered
// without Redis until then. It holds at most max entries: when full, it
// drops expired entries (at most once a second), else an arbitrary one.
type denyCache struct {
	mu        sync.Mutex
	max       int
	m         map[string]denyEntry
	lastSweep time.Time
}

type denyEntry struct {
	until   time.Time // answer from memory before this (a little early)
	retryAt time.Time // Retry-After points here (a little late)
	tight   int       // the rate that rejects
}

func newDenyCache(max int) *denyCache {
	return &denyCache{max: max, m: make(map[string]denyEntry)}
}

func (c *denyCache) get(id string, now time.Time) (denyEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	if !ok {
		return e, false
	}
	if !now.Before(e.until) {
		delete(c.m, id)
		return e, false
	}
	return e, true
}

func (c *denyCache) put(id string, e denyEntry, now time.Time) {
	if !now.Before(e.until) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[id]; !ok && len(c.m) >= c.max {
		if now.Sub(c.lastSweep) >= time.Second {
			c.lastSweep = now
			for k, v := range c.m {
				if !now.Before(v.until) {
					delete(c.m, k)
				}
			}
		}
		// Still full: drop some entry; it only costs a Redis call later.
		for k := range c.m {
			if len(c.m) < c.max {
				break
			}
			delete(c.m, k)
		}
	}
	c.m[id] = e
}

func (c *denyCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*RedisRateLimit)(nil)
	_ caddy.Validator             = (*RedisRateLimit)(nil)
	_ caddy.CleanerUpper          = (*RedisRateLimit)(nil)
	_ caddyhttp.MiddlewareHandler = (*RedisRateLimit)(nil)
)

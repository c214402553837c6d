package redisfence

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(RedisFence{})
}

// Defaults of redis_fence.
const (
	DefaultFenceStatus = http.StatusConflict
	DefaultFencePrefix = "caddy:fence:"
	DefaultFenceRetain = 24 * time.Hour
	DefaultFenceToken  = "{http.request.header." + shared.DefaultFencingHeader + "}"
)

// maxTokenLead is how far ahead of Redis TIME a token may be: tokens are
// Redis TIME in µs plus one per acquisition, so a token an hour ahead is
// no token of a lock; admitted, it would fence every real holder out.
const maxTokenLead = time.Hour

var (
	//go:embed scripts/fence_admit.lua
	fenceAdmitLua    string
	fenceAdmitScript = redisconn.NewScript(fenceAdmitLua)
)

// Errors of redis_fence.
var (
	ErrStaleToken   = errors.New("redisdlm: stale fencing token: a later holder of the lock has written")
	ErrBadToken     = errors.New("redisdlm: missing or malformed fencing token")
	ErrFutureToken  = errors.New("redisdlm: fencing token from the future (no lock issued it)")
	errFenceUnknown = errors.New("redisdlm: fence could not ask redis")
	// errFenceRestarted: the fence's Redis process changed twice during
	// one write's check; no verdict can be trusted.
	errFenceRestarted = errors.New("redisdlm: the fence's redis restarted while a token was checked")
)

// RedisFence admits a write only when its fencing token is at least the
// highest token admitted so far for its key, checked and recorded
// atomically in Redis; a lower token — a holder whose lease passed on to
// another — gets `status` and never reaches the upstream. Put it in front
// of the storage (its own Caddy, or the writing route of a second tier),
// behind the redis_lock that issued the token: fencing then protects the
// data without code in the upstream. The guarantee is "stale when it
// reaches the fence": a write delayed after the fence is the storage's own
// check. A token older than the fence's Redis process is refused too: a
// restart without persistence loses the records. The lock needs `permits 1`
// (holders of several permits hold different tokens).
type RedisFence struct {
	// The lock's key, as a template rendered per request with the lock's
	// key-hashing rules. A key that renders empty, or with a placeholder
	// unknown at request time, is answered 400.
	// Default: `{http.request.uri.path}`.
	Key string `json:"key,omitempty"`

	// Where the write's fencing token comes from, a template.
	// Default: `{http.request.header.Lock-Fencing-Token}`.
	Token string `json:"token,omitempty"`

	// HTTP status for a stale, missing or malformed token. Default: 409.
	Status int `json:"status,omitempty"`

	// How long the highest token of a key is kept after its last admitted
	// write. A token older than Redis TIME − retain is refused as stale
	// even without a record, since tokens carry a Redis-TIME floor in µs:
	// so no hold may outlast retain (set `max_hold` on the lock).
	// Default: 24h.
	Retain caddy.Duration `json:"retain,omitempty"`

	// Namespace of the Redis keys (never the lock's own counter).
	// Default: "caddy:fence:".
	Prefix string `json:"prefix,omitempty"`

	// How logs and metrics name this handler (their handler label).
	// Default: none ("fence-" and a short hash of the config).
	Name string `json:"name,omitempty"`

	// Redis connection settings: one logical Redis (a server, a Cluster or
	// a Sentinel), the lock's or any.
	shared.RedisConfig

	logger    *zap.Logger
	label     string
	writes    [len(shared.FenceResults)]prometheus.Counter // as fenceResults
	obs       *shared.LabelClaim
	keyTmpl   *shared.KeyTemplate
	tokenTmpl string // Token with the Caddyfile shorthands expanded
	client    *shared.Client
	clientKey string
	timeout   time.Duration
	warn      *shared.Warnings
	noStart   *sync.Once // the warning that the Redis process start is unknown
}

// CaddyModule returns the Caddy module information.
func (RedisFence) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.redis_fence", New: func() caddy.Module { return new(RedisFence) }}
}

// Provision sets defaults, then takes the shared Redis client; it never
// dials.
func (h *RedisFence) Provision(ctx caddy.Context) error {
	h.label = shared.HandlerLabel("fence", h.Name, h)
	h.logger = ctx.Logger().With(zap.String("handler", h.label))
	h.warn = shared.NewWarnings(time.Second)
	h.noStart = new(sync.Once)
	if h.Key == "" {
		h.Key = shared.DefaultLockKey
	}
	if h.Token == "" {
		h.Token = DefaultFenceToken
	}
	h.tokenTmpl = shared.ExpandShorthands(h.Token) // as Validate checks it, in JSON too
	if h.Status == 0 {
		h.Status = DefaultFenceStatus
	}
	if h.Retain == 0 {
		h.Retain = caddy.Duration(DefaultFenceRetain)
	}
	if h.Prefix == "" {
		h.Prefix = DefaultFencePrefix
	}
	if err := h.Validate(); err != nil {
		return err
	}
	if err := shared.RegisterMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	var err error
	if h.keyTmpl, err = shared.ParseKeyTemplate(h.Key); err != nil {
		return fmt.Errorf("redis_fence: key: %w", err)
	}
	if h.client, h.clientKey, h.timeout, err = h.RedisConfig.AcquireOne("redis_fence"); err != nil {
		return err
	}
	h.writes = shared.NewFenceSeries(h.label)
	h.obs = shared.ObserveHandler("fence", h.label, h.logger, h.client)
	return nil
}

// Validate checks the configuration; it is pure.
func (h *RedisFence) Validate() error {
	if err := h.RedisConfig.Validate(false); err != nil {
		return fmt.Errorf("redis_fence: %w", err)
	}
	if h.Key != "" {
		if err := shared.CheckKeyTemplate(h.Key); err != nil {
			return fmt.Errorf("redis_fence: key: %w", err)
		}
	}
	if err := shared.CheckTemplate(h.Token); err != nil {
		return fmt.Errorf("redis_fence: token: %w", err)
	}
	if h.Status != 0 {
		if err := shared.CheckStatus(h.Status); err != nil {
			return fmt.Errorf("redis_fence: status: %w", err)
		}
	}
	if h.Retain != 0 {
		if err := checkRetain(time.Duration(h.Retain)); err != nil {
			return fmt.Errorf("redis_fence: retain: %w", err)
		}
	}
	if err := shared.CheckPrefix(h.Prefix); err != nil {
		return fmt.Errorf("redis_fence: prefix: %w", err)
	}
	return nil
}

// checkRetain accepts how long a key's highest token is kept: at least a
// second.
func checkRetain(d time.Duration) error {
	if d < time.Second {
		return fmt.Errorf("want at least 1s, got %s", d)
	}
	return nil
}

// Cleanup gives back the shared client.
func (h *RedisFence) Cleanup() error {
	h.obs.Release()
	shared.ReleaseClient(h.clientKey)
	h.clientKey = ""
	return nil
}

// ServeHTTP admits the write to the next handler, or answers `status`
// (stale, missing or malformed token), 400 (a key that cannot render) or
// 503 (Redis could not be asked: a fence that admits blindly is no fence).
func (h *RedisFence) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	key, err := h.keyTmpl.Render(repl)
	if err != nil {
		return caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("rendering fence key %q: %w", h.keyTmpl.Raw, err))
	}
	raw := repl.ReplaceAll(h.tokenTmpl, "")
	token, err := strconv.ParseUint(raw, 10, 63)
	if err != nil || raw == "" || raw[0] == '+' {
		h.writes[shared.FenceMalformed].Inc()
		return caddyhttp.Error(h.Status, fmt.Errorf("%w: %q", ErrBadToken, raw))
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.timeout)
	defer cancel()
	h.client.Conn.Use()
	n, err := h.admit(ctx, key, token)
	h.client.Conn.Unuse()
	if err != nil {
		h.writes[shared.FenceError].Inc()
		if due, k := h.warn.Due(); due {
			h.logger.Warn("redis unreachable for the fence; answering 503", zap.Error(err), zap.Int64("requests_since_last_warning", k))
		}
		w.Header().Set("Retry-After", "1")
		return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("%w: %v", errFenceUnknown, err))
	}
	switch n {
	case 1:
		h.writes[shared.FenceAdmitted].Inc()
		return next.ServeHTTP(w, r)
	case -1:
		h.writes[shared.FenceMalformed].Inc()
		return caddyhttp.Error(h.Status, fmt.Errorf("%w: %d", ErrFutureToken, token))
	}
	h.writes[shared.FenceStale].Inc()
	if c := h.logger.Check(zapcore.DebugLevel, "fence: stale token refused"); c != nil {
		c.Write(zap.String("key", key), zap.Uint64("token", token), zap.Bool("before_redis_start", n == -2))
	}
	if n == -2 {
		return caddyhttp.Error(h.Status, fmt.Errorf("%w (token %d is older than the fence's redis process, which may have lost the records)", ErrStaleToken, token))
	}
	return caddyhttp.Error(h.Status, fmt.Errorf("%w (token %d)", ErrStaleToken, token))
}

// admit runs the fence's script with the start of the fence's Redis
// process, so that a token older than the process is refused: a restart
// without persistence loses the records the token was refused by. The
// connection hook reads the start before a new connection's first
// command, so an answer from a process the call did not know of is seen
// with Started already changed: that verdict does not count, and the call
// is made again with the new start (once; a second change answers 503).
func (h *RedisFence) admit(ctx context.Context, key string, token uint64) (int64, error) {
	keys := []string{shared.StoredKey(h.Prefix, key)}
	start := h.client.Check.Started()
	for range 2 {
		n, err := fenceAdmitScript.Run(ctx, h.client.Redis, keys, strconv.FormatUint(token, 10),
			time.Duration(h.Retain).Milliseconds(), maxTokenLead.Microseconds(), start).Int64()
		now := h.client.Check.Started()
		if err != nil || now == start {
			if err == nil && now == 0 {
				h.noStart.Do(h.warnNoStart)
			}
			return n, err
		}
		start = now
	}
	return 0, errFenceRestarted
}

// warnNoStart says once that the fence's Redis keeps its process start
// from it, so a restart of it goes unnoticed.
func (h *RedisFence) warnNoStart() {
	h.logger.Warn("restart protection off: the fence cannot read when its redis process started (INFO server refused); "+
		"after a restart that loses the records a stale token can be admitted", zap.String("server", h.client.Settings.Display()))
}

// Interface guards
var (
	_ caddy.Provisioner           = (*RedisFence)(nil)
	_ caddy.Validator             = (*RedisFence)(nil)
	_ caddy.CleanerUpper          = (*RedisFence)(nil)
	_ caddyhttp.MiddlewareHandler = (*RedisFence)(nil)
)

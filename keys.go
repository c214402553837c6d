package redisdlm

// The handlers' own key rules (the generic ones are internal/shared's):
// the lock's keys rendered and sorted, the rate limiter's limit id.

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// renderKeys renders the lock's key templates into sorted, deduplicated
// Redis keys and a display form for logs and placeholders. A template with
// an unknown or empty placeholder fails the request (400): an unknown one
// is logged once per template as a warning, an empty one at debug level.
func (h *RedisLock) renderKeys(repl *caddy.Replacer) ([]string, string, error) {
	rendered := make([]string, 0, len(h.keyTmpls))
	for _, t := range h.keyTmpls {
		k, err := t.Render(repl)
		if err != nil {
			if errors.Is(err, shared.ErrKeyUnknown) && h.warn.First(t.Raw) {
				h.logger.Warn("lock key uses a placeholder unknown for this request; answering 400",
					zap.String("template", t.Raw), zap.Error(err))
			} else if c := h.logger.Check(zapcore.DebugLevel, "lock key has an empty placeholder; answering 400"); c != nil {
				c.Write(zap.String("template", t.Raw), zap.Error(err))
			}
			return nil, "", fmt.Errorf("rendering lock key %q: %w", t.Raw, err)
		}
		rendered = append(rendered, k)
	}
	rendered = shared.SortKeys(rendered)
	keys := make([]string, len(rendered))
	for i, k := range rendered {
		keys[i] = shared.StoredKey(h.Prefix, k)
	}
	return keys, strings.Join(rendered, ","), nil
}

// limitID renders the rate limiter's key template for r: the identity of
// its limit, used inside the Redis hash tag. A key with an unknown or empty
// placeholder falls back to the client IP (logged once per template).
func (h *RedisRateLimit) limitID(r *http.Request, repl *caddy.Replacer) string {
	key, err := h.keyTmpl.Render(repl)
	if err != nil {
		if h.warn.First(h.keyTmpl.Raw) {
			h.logger.Warn("rate limit key has a placeholder unknown or empty for this request; limiting by client IP instead (logged once)",
				zap.String("key_template", h.keyTmpl.Raw), zap.Error(err))
		}
		return limitIDFor("", h.keyTmpl.IP.Group(shared.ClientIP(r)))
	}
	return limitIDFor(key, "")
}

// limitIDFor maps a rendered key to the id in the hash tag, injectively:
// an empty key becomes "ip/<client IP>"; a key that is long, holds a brace
// (which would break the hash tag) or could be mistaken for one of those
// forms becomes "sha256:<hex>"; any other key is kept as it is.
func limitIDFor(key, ip string) string {
	if key == "" {
		return "ip/" + ip
	}
	if len(key) > shared.MaxKeyLen || strings.ContainsAny(key, "{}") ||
		strings.HasPrefix(key, "ip/") || strings.HasPrefix(key, "sha256:") {
		return shared.KeyHash(key)
	}
	return key
}

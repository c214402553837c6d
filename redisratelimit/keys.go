package redisratelimit

// The rate limiter's own key rule (the generic ones are internal/shared's):
// its limit id.

import (
	"net/http"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// statusClientClosedRequest is logged when the client went away while
// waiting.
const statusClientClosedRequest = shared.StatusClientClosedRequest

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

package redislock

// The lock's keys: its templates rendered per request (the generic key
// rules are internal/shared's).

import (
	"errors"
	"fmt"
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

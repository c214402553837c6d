package shared

// How a handler is named: its `name` (checked here) or a label made from
// its config, the same in metrics, logs, events and headers.

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

// HandlerLabel is how metrics, logs and stacked headers name a handler:
// its name, else kind and a short hash of its JSON config (stable while the
// config does not change). Call it before defaults are filled in.
func HandlerLabel(kind, name string, cfg any) string {
	if name != "" {
		return name
	}
	b, _ := json.Marshal(cfg)
	var v any
	if json.Unmarshal(b, &v) == nil {
		b, _ = json.Marshal(withoutSecrets(v))
	}
	sum := sha256.Sum256(b)
	return kind + "-" + hex.EncodeToString(sum[:4])
}

// withoutSecrets is a decoded JSON config with its secrets taken out, so
// that the label (in /metrics, logs and response headers) says nothing
// about them: "password" fields are dropped and the passwords of Redis
// URLs masked.
func withoutSecrets(v any) any {
	switch t := v.(type) {
	case map[string]any:
		delete(t, "password")
		for k, e := range t {
			t[k] = withoutSecrets(e)
		}
	case []any:
		for i, e := range t {
			t[i] = withoutSecrets(e)
		}
	case string:
		if strings.Contains(t, "@") {
			return redisconn.RedactURL(t)
		}
	}
	return v
}

// CheckHandlerName accepts letters, digits, '-', '_' and '.', not all
// digits (a number addresses a handler by its position).
func CheckHandlerName(name string) error {
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

package redisdlm

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Every key rule of both handlers: which templates are allowed, how they
// render per request, how a rendered key becomes a Redis key (hash tag,
// hashing of long or odd keys), the lock's companion keys, the rate
// limiter's ids and its client-IP fallback.

// maxKeyLen is the longest rendered key stored as is; longer keys are
// stored as their SHA-256, so a client cannot make Redis keys grow without
// bound.
const maxKeyLen = 200

// knownNamespaces are the placeholder namespaces that can render at request
// time in an HTTP handler. A key placeholder outside them would render empty
// for every request and silently put every client in one bucket.
var knownNamespaces = []string{"http.", "env.", "time.", "system.", "file.", "vars."}

// templatePlaceholders returns the placeholder names in tmpl, honouring
// Caddy's escapes (\{ and \}).
func templatePlaceholders(tmpl string) ([]string, error) {
	var out []string
	for i := 0; i < len(tmpl); i++ {
		switch tmpl[i] {
		case '\\':
			i++
		case '{':
			end := strings.IndexByte(tmpl[i:], '}')
			if end < 0 {
				return nil, fmt.Errorf("unclosed placeholder in %q", tmpl)
			}
			out = append(out, tmpl[i+1:i+end])
			i += end
		}
	}
	return out, nil
}

// checkKeyTemplate rejects a key template with a placeholder outside the
// namespaces Caddy fills in for HTTP requests.
func checkKeyTemplate(tmpl string) error {
	if strings.TrimSpace(tmpl) == "" {
		return fmt.Errorf("key template is empty")
	}
	names, err := templatePlaceholders(tmpl)
	if err != nil {
		return err
	}
	for _, n := range names {
		ok := false
		for _, ns := range knownNamespaces {
			if strings.HasPrefix(n, ns) {
				ok = true
				break
			}
		}
		if !ok {
			return fmt.Errorf("key %q: placeholder {%s} is outside Caddy's known namespaces (http.*, env.*, time.*, system.*, file.*); it would render empty for every request", tmpl, n)
		}
	}
	return nil
}

// renderKey renders a key template for one request. It fails when a
// placeholder is unknown at request time (e.g. {http.auth.user.id} with no
// authentication before this handler); header placeholders are always
// known and render "" when the header is missing.
func renderKey(repl *caddy.Replacer, tmpl string) (string, error) {
	return repl.ReplaceOrErr(tmpl, false, true)
}

// keyHash is the one hashing rule for keys: "sha256:" and the hex digest.
// A rendered key that starts with "sha256:" is always hashed again, so two
// different keys can never share a Redis key.
func keyHash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// storedKey turns a rendered key into the Redis key: prefix plus the key in
// a hash tag, so every Redis key of one lock or limit is on one Cluster
// slot. Keys over maxKeyLen bytes, or with braces, are stored as their
// SHA-256.
func storedKey(prefix, rendered string) string {
	// Braces would end the hash tag early (the lock's keys could land on
	// different Cluster slots); a key that looks hashed already is hashed
	// again, so two different keys can never share a Redis key.
	if len(rendered) > maxKeyLen || strings.ContainsAny(rendered, "{}") || strings.HasPrefix(rendered, "sha256:") {
		rendered = keyHash(rendered)
	}
	return prefix + "{" + rendered + "}"
}

// fenceKey is the fencing counter of a lock key; waitqKey the list of
// instances waiting for it. Both share the lock key's hash tag.
func fenceKey(lockKey string) string { return lockKey + ":fence" }
func waitqKey(lockKey string) string { return lockKey + ":waitq" }

// sortKeys deduplicates and sorts keys.
func sortKeys(keys []string) []string {
	sort.Strings(keys)
	out := keys[:0]
	for i, k := range keys {
		if i == 0 || k != keys[i-1] {
			out = append(out, k)
		}
	}
	return out
}

// renderKeys renders the lock's key templates into sorted, deduplicated
// Redis keys and a display form for logs and placeholders.
func (h *RedisLock) renderKeys(repl *caddy.Replacer) ([]string, string, error) {
	rendered := make([]string, 0, len(h.Keys))
	for _, tmpl := range h.Keys {
		k, err := renderKey(repl, tmpl)
		if err != nil {
			if h.warn.first(tmpl) {
				h.logger.Warn("lock key uses a placeholder unknown for this request; answering 400",
					zap.String("template", tmpl), zap.Error(err))
			}
			return nil, "", fmt.Errorf("rendering lock key %q: %w", tmpl, err)
		}
		if k == "" {
			h.logger.Debug("lock key rendered empty; answering 400", zap.String("template", tmpl))
			return nil, "", fmt.Errorf("lock key %q rendered empty", tmpl)
		}
		rendered = append(rendered, k)
	}
	rendered = sortKeys(rendered)
	keys := make([]string, len(rendered))
	for i, k := range rendered {
		keys[i] = storedKey(h.Prefix, k)
	}
	return keys, strings.Join(rendered, ","), nil
}

// limitID renders the rate limiter's key template for r: the identity of
// its limit, used inside the Redis hash tag.
func (h *RedisRateLimit) limitID(r *http.Request, repl *caddy.Replacer) string {
	var key string
	var err error
	if h.keyPH != "" {
		// What ReplaceOrErr does for a template that is one placeholder.
		if v, ok := repl.Get(h.keyPH); ok {
			key = caddy.ToString(v)
		} else {
			err = fmt.Errorf("unrecognized placeholder {%s}", h.keyPH)
		}
	} else {
		key, err = repl.ReplaceOrErr(h.key, false, true)
	}
	if err != nil {
		if h.warn.first(h.key) {
			h.logger.Warn("rate limit key has a placeholder unknown for this request; limiting by client IP instead (logged once)",
				zap.String("key_template", h.key), zap.Error(err))
		}
		key = ""
	}
	if key == "" {
		return limitIDFor("", clientIP(r))
	}
	return limitIDFor(key, "")
}

// wholePlaceholder returns the name of the placeholder that is all of
// template (as in "{http.request.header.X-Key}"), or "" when the template is
// anything else; such a key is rendered by one lookup, without parsing.
func wholePlaceholder(template string) string {
	if len(template) < 3 || template[0] != '{' || template[len(template)-1] != '}' {
		return ""
	}
	name := template[1 : len(template)-1]
	if strings.ContainsAny(name, "{}\\") || strings.HasPrefix(name, "file.") {
		return ""
	}
	return name
}

// limitIDFor maps a rendered key to the id in the hash tag, injectively:
// an empty key becomes "ip/<client IP>"; a key that is long, holds a brace
// (which would break the hash tag) or could be mistaken for one of those
// forms becomes "sha256:<hex>"; any other key is kept as it is.
func limitIDFor(key, ip string) string {
	if key == "" {
		return "ip/" + ip
	}
	if len(key) > maxKeyLen || strings.ContainsAny(key, "{}") ||
		strings.HasPrefix(key, "ip/") || strings.HasPrefix(key, "sha256:") {
		return keyHash(key)
	}
	return key
}

// clientIP is Caddy's client IP of r, or the peer's address.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

package redisdlm

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
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
// for every request and silently put every client in one bucket. Caddyfile
// shorthands ({client_ip}, {header.X}, {vars.x}, ...) are expanded first, in
// the Caddyfile and in JSON alike.
var knownNamespaces = []string{"http.", "env.", "time.", "system.", "file."}

// Errors of a key that cannot identify a client: the request is answered
// 400 (redis_lock) or limited by its client IP (redis_ratelimit).
var (
	errKeyUnknown = errors.New("placeholder unknown for this request")
	errKeyEmpty   = errors.New("placeholder rendered empty")
)

// keyTemplate is a key template compiled once: its literal text and its
// placeholders, in order.
type keyTemplate struct {
	raw   string
	parts []keyPart
	ip    ipPrefix // how the client IP placeholder is grouped (rate limiter)
}

// clientIPPlaceholder is what {client_ip} stands for.
const clientIPPlaceholder = "http.vars." + caddyhttp.ClientIPVarKey

// ipPrefix groups client IPs by network prefix: bits of IPv4 and of IPv6
// (0, 0: every address as it is).
type ipPrefix struct{ v4, v6 int }

// group returns the network of ip under the prefix ("192.0.2.0/24"), or
// ip as it is: without a prefix, or when it is no IP address. IPv4-mapped
// IPv6 counts as IPv4; a zone is dropped.
func (p ipPrefix) group(ip string) string {
	if p.v4 == 0 && p.v6 == 0 {
		return ip
	}
	a, err := netip.ParseAddr(ip)
	if err != nil {
		return ip
	}
	a = a.WithZone("").Unmap()
	bits := p.v6
	if a.Is4() {
		bits = p.v4
	}
	if pfx, err := a.Prefix(bits); err == nil {
		return pfx.String()
	}
	return ip
}

// keyPart is literal text, or a placeholder when ph is set.
type keyPart struct {
	lit, ph string
}

// parseKeyTemplate expands Caddyfile shorthands in raw, checks that every
// placeholder is in a known namespace, and compiles it. Caddy's escapes \{
// and \} stand for literal braces.
func parseKeyTemplate(raw string) (*keyTemplate, error) {
	s := expandShorthands(raw)
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("key template is empty")
	}
	t := &keyTemplate{raw: s}
	var lit strings.Builder
	flush := func() {
		if lit.Len() > 0 {
			t.parts = append(t.parts, keyPart{lit: lit.String()})
			lit.Reset()
		}
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\' && i+1 < len(s) && (s[i+1] == '{' || s[i+1] == '}'):
			lit.WriteByte(s[i+1])
			i++
		case c == '{':
			end := strings.IndexByte(s[i:], '}')
			if end < 0 {
				return nil, fmt.Errorf("unclosed placeholder in %q", raw)
			}
			name := s[i+1 : i+end]
			if err := checkPlaceholder(name); err != nil {
				return nil, fmt.Errorf("key %q: %w", raw, err)
			}
			flush()
			t.parts = append(t.parts, keyPart{ph: name})
			i += end
		default:
			lit.WriteByte(c)
		}
	}
	flush()
	return t, nil
}

// checkPlaceholder rejects a placeholder that can never render: one
// outside the known namespaces, or a field of http.request.* that does not
// exist (the fields of http.request.* are fixed in Caddy v2.11, but for
// the open header.*, cookie.*, uri.query.* and tls.*).
func checkPlaceholder(name string) error {
	if !knownNamespace(name) {
		return fmt.Errorf("placeholder {%s} is outside Caddy's known namespaces (http.*, env.*, time.*, system.*, file.*); it would render empty for every request", name)
	}
	return checkRequestField(name)
}

// checkRequestField rejects a field of http.request.* that does not exist.
func checkRequestField(name string) error {
	if field, ok := strings.CutPrefix(name, "http.request."); ok && !requestField(field) {
		return fmt.Errorf("placeholder {%s} does not exist: http.request.%s is no field of Caddy's request placeholders (header.<name>, cookie.<name>, uri.query.<name>, uri.path, host, method, remote.host, ...)", name, field)
	}
	return nil
}

// requestFields are the fixed fields of Caddy's http.request.* placeholders
// (modules/caddyhttp/replacer.go, v2.11).
var requestFields = []string{"method", "scheme", "proto", "proto_name", "host", "port", "hostport",
	"local", "local.host", "local.port", "remote", "remote.host", "remote.port",
	"uri", "uri_escaped", "uri.path", "uri.path_escaped", "uri.path.file", "uri.path.dir",
	"uri.path.file.base", "uri.path.file.ext", "uri.query", "uri.query_escaped", "uri.prefixed_query",
	"duration", "duration_ms", "uuid", "body", "body_base64",
	"orig_method", "orig_uri", "orig_uri.path", "orig_uri.path.file", "orig_uri.path.file_escaped",
	"orig_uri.path.dir", "orig_uri.query", "orig_uri.prefixed_query"}

// requestField reports whether http.request.<field> can render.
func requestField(field string) bool {
	if slices.Contains(requestFields, field) {
		return true
	}
	for _, open := range []string{"header.", "cookie.", "uri.query.", "tls."} {
		if rest, ok := strings.CutPrefix(field, open); ok && rest != "" {
			return true
		}
	}
	for _, indexed := range []string{"host.labels.", "uri.path.", "orig_uri.path.", "remote.host/"} {
		if rest, ok := strings.CutPrefix(field, indexed); ok && rest != "" && strings.Trim(rest, "0123456789,") == "" {
			return true
		}
	}
	return false
}

// checkTemplate checks every placeholder of a template (a rate, a cost, a
// fingerprint), after Caddyfile shorthands: any name may be set by a
// handler before (map, vars), but a field of http.request.* must exist.
func checkTemplate(raw string) error {
	return eachPlaceholder(raw, checkRequestField)
}

// eachPlaceholder calls f with the name of every placeholder of a
// template, after Caddyfile shorthands, and stops at its first error.
func eachPlaceholder(raw string, f func(name string) error) error {
	s := expandShorthands(raw)
	for {
		i := strings.IndexByte(s, '{')
		if i < 0 {
			return nil
		}
		if i > 0 && s[i-1] == '\\' {
			s = s[i+1:]
			continue
		}
		end := strings.IndexByte(s[i:], '}')
		if end < 0 {
			return fmt.Errorf("unclosed placeholder in %q", raw)
		}
		if err := f(s[i+1 : i+end]); err != nil {
			return err
		}
		s = s[i+end+1:]
	}
}

// templateHeaders lists the request headers a template reads: X for
// {http.request.header.X} (or {header.X}), Cookie for a cookie placeholder.
func templateHeaders(raw string) []string {
	var out []string
	_ = eachPlaceholder(raw, func(name string) error {
		if hdr, ok := strings.CutPrefix(name, "http.request.header."); ok {
			out = append(out, hdr)
		} else if strings.HasPrefix(name, "http.request.cookie.") {
			out = append(out, "Cookie")
		}
		return nil
	})
	return out
}

func knownNamespace(name string) bool {
	for _, ns := range knownNamespaces {
		if strings.HasPrefix(name, ns) {
			return true
		}
	}
	return false
}

// checkKeyTemplate reports what parseKeyTemplate would reject.
func checkKeyTemplate(raw string) error {
	_, err := parseKeyTemplate(raw)
	return err
}

// render renders the template for one request. Every placeholder must be
// known and non-empty (errKeyUnknown, errKeyEmpty, naming it): a key with a
// hole, such as "user:" for a request without the user header, would put
// every such client in one shared lock or bucket.
func (t *keyTemplate) render(repl *caddy.Replacer) (string, error) {
	if len(t.parts) == 1 && t.parts[0].ph != "" {
		return t.value(repl, t.parts[0].ph)
	}
	var b strings.Builder
	for _, p := range t.parts {
		if p.ph == "" {
			b.WriteString(p.lit)
			continue
		}
		v, err := t.value(repl, p.ph)
		if err != nil {
			return "", err
		}
		b.WriteString(v)
	}
	return b.String(), nil
}

func (t *keyTemplate) value(repl *caddy.Replacer, name string) (string, error) {
	v, ok := repl.Get(name)
	if !ok {
		return "", fmt.Errorf("{%s}: %w", name, errKeyUnknown)
	}
	s := caddy.ToString(v)
	if s == "" {
		return "", fmt.Errorf("{%s}: %w", name, errKeyEmpty)
	}
	if name == clientIPPlaceholder {
		s = t.ip.group(s)
	}
	return s, nil
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
// Redis keys and a display form for logs and placeholders. A template with
// an unknown or empty placeholder fails the request (400): an unknown one
// is logged once per template as a warning, an empty one at debug level.
func (h *RedisLock) renderKeys(repl *caddy.Replacer) ([]string, string, error) {
	rendered := make([]string, 0, len(h.keyTmpls))
	for _, t := range h.keyTmpls {
		k, err := t.render(repl)
		if err != nil {
			if errors.Is(err, errKeyUnknown) && h.warn.First(t.raw) {
				h.logger.Warn("lock key uses a placeholder unknown for this request; answering 400",
					zap.String("template", t.raw), zap.Error(err))
			} else if c := h.logger.Check(zapcore.DebugLevel, "lock key has an empty placeholder; answering 400"); c != nil {
				c.Write(zap.String("template", t.raw), zap.Error(err))
			}
			return nil, "", fmt.Errorf("rendering lock key %q: %w", t.raw, err)
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
// its limit, used inside the Redis hash tag. A key with an unknown or empty
// placeholder falls back to the client IP (logged once per template).
func (h *RedisRateLimit) limitID(r *http.Request, repl *caddy.Replacer) string {
	key, err := h.keyTmpl.render(repl)
	if err != nil {
		if h.warn.First(h.keyTmpl.raw) {
			h.logger.Warn("rate limit key has a placeholder unknown or empty for this request; limiting by client IP instead (logged once)",
				zap.String("key_template", h.keyTmpl.raw), zap.Error(err))
		}
		return limitIDFor("", h.keyTmpl.ip.group(clientIP(r)))
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

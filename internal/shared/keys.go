package shared

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
)

// Every key rule of both handlers: which templates are allowed, how they
// Render per request, how a rendered key becomes a Redis key (hash tag,
// hashing of long or odd keys), the lock's companion keys, the rate
// limiter's ids and its client-IP fallback.

// MaxKeyLen is the longest rendered key stored as is; longer keys are
// stored as their SHA-256, so a client cannot make Redis keys grow without
// bound.
const MaxKeyLen = 200

// knownNamespaces are the placeholder namespaces that can render at request
// time in an HTTP handler. A key placeholder outside them would render empty
// for every request and silently put every client in one bucket. Caddyfile
// shorthands ({client_ip}, {header.X}, {vars.x}, ...) are expanded first, in
// the Caddyfile and in JSON alike.
var knownNamespaces = []string{"http.", "env.", "time.", "system.", "file."}

// Errors of a key that cannot identify a client: the request is answered
// 400 (redis_lock) or limited by its client IP (redis_ratelimit).
var (
	ErrKeyUnknown = errors.New("placeholder unknown for this request")
	ErrKeyEmpty   = errors.New("placeholder rendered empty")
)

// KeyTemplate is a key template compiled once: its literal text and its
// placeholders, in order.
type KeyTemplate struct {
	Raw   string // the template as configured
	parts []keyPart
	IP    IPPrefix // how the client IP placeholder is grouped (rate limiter)
}

// clientIPPlaceholder is what {client_ip} stands for.
const clientIPPlaceholder = "http.vars." + caddyhttp.ClientIPVarKey

// IPPrefix groups client IPs by network prefix: bits of IPv4 and of IPv6
// (0, 0: every address as it is).
type IPPrefix struct{ V4, V6 int }

// Group returns the network of ip under the prefix ("192.0.2.0/24"), or
// ip as it is: without a prefix, or when it is no IP address. IPv4-mapped
// IPv6 counts as IPv4; a zone is dropped.
func (p IPPrefix) Group(ip string) string {
	if p.V4 == 0 && p.V6 == 0 {
		return ip
	}
	a, err := netip.ParseAddr(ip)
	if err != nil {
		return ip
	}
	a = a.WithZone("").Unmap()
	bits := p.V6
	if a.Is4() {
		bits = p.V4
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

// ParseKeyTemplate expands Caddyfile shorthands in raw, checks that every
// placeholder is in a known namespace, and compiles it. Caddy's escapes \{
// and \} stand for literal braces.
func ParseKeyTemplate(raw string) (*KeyTemplate, error) {
	s := ExpandShorthands(raw)
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("key template is empty")
	}
	t := &KeyTemplate{Raw: s}
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

// CheckTemplate checks every placeholder of a template (a rate, a cost, a
// fingerprint), after Caddyfile shorthands: any name may be set by a
// handler before (map, vars), but a field of http.request.* must exist.
func CheckTemplate(raw string) error {
	return EachPlaceholder(raw, checkRequestField)
}

// EachPlaceholder calls f with the name of every placeholder of a
// template, after Caddyfile shorthands, and stops at its first error.
func EachPlaceholder(raw string, f func(name string) error) error {
	s := ExpandShorthands(raw)
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

// TemplateHeaders lists the request headers a template reads: X for
// {http.request.header.X} (or {header.X}), Cookie for a cookie placeholder.
func TemplateHeaders(raw string) []string {
	var out []string
	_ = EachPlaceholder(raw, func(name string) error {
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

// CheckKeyTemplate reports what parseKeyTemplate would reject.
func CheckKeyTemplate(raw string) error {
	_, err := ParseKeyTemplate(raw)
	return err
}

// Render renders the template for one request. Every placeholder must be
// known and non-empty (errKeyUnknown, errKeyEmpty, naming it): a key with a
// hole, such as "user:" for a request without the user header, would put
// every such client in one shared lock or bucket.
func (t *KeyTemplate) Render(repl *caddy.Replacer) (string, error) {
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

func (t *KeyTemplate) value(repl *caddy.Replacer, name string) (string, error) {
	v, ok := repl.Get(name)
	if !ok {
		return "", fmt.Errorf("{%s}: %w", name, ErrKeyUnknown)
	}
	s := caddy.ToString(v)
	if s == "" {
		return "", fmt.Errorf("{%s}: %w", name, ErrKeyEmpty)
	}
	if name == clientIPPlaceholder {
		s = t.IP.Group(s)
	}
	return s, nil
}

// KeyHash is the one hashing rule for keys: "sha256:" and the hex digest.
// A rendered key that starts with "sha256:" is always hashed again, so two
// different keys can never share a Redis key.
func KeyHash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// StoredKey turns a rendered key into the Redis key: prefix plus the key in
// a hash tag, so every Redis key of one lock or limit is on one Cluster
// slot. Keys over maxKeyLen bytes, or with braces, are stored as their
// SHA-256.
func StoredKey(prefix, rendered string) string {
	// Braces would end the hash tag early (the lock's keys could land on
	// different Cluster slots); a key that looks hashed already is hashed
	// again, so two different keys can never share a Redis key.
	if len(rendered) > MaxKeyLen || strings.ContainsAny(rendered, "{}") || strings.HasPrefix(rendered, "sha256:") {
		rendered = KeyHash(rendered)
	}
	return prefix + "{" + rendered + "}"
}

// SortKeys deduplicates and sorts keys.
func SortKeys(keys []string) []string {
	sort.Strings(keys)
	out := keys[:0]
	for i, k := range keys {
		if i == 0 || k != keys[i-1] {
			out = append(out, k)
		}
	}
	return out
}

// ClientIP is Caddy's client IP of r, or the peer's address.
func ClientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// Defaults the lock and the fence share: the fence checks the lock's key
// and reads the token from the lock's header unless told otherwise.
const (
	DefaultLockKey       = "{http.request.uri.path}"
	DefaultFencingHeader = "Lock-Fencing-Token"
)

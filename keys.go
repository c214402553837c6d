package redisdlm

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

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

// storedKey turns a rendered key into the Redis key: prefix plus the key in
// a hash tag, so every Redis key of one lock or limit is on one Cluster
// slot. Keys over maxKeyLen bytes, or with braces, are stored as their
// SHA-256.
func storedKey(prefix, rendered string) string {
	// Braces would end the hash tag early (the lock's keys could land on
	// different Cluster slots); a key that looks hashed already is hashed
	// again, so two different keys can never share a Redis key.
	if len(rendered) > maxKeyLen || strings.ContainsAny(rendered, "{}") || strings.HasPrefix(rendered, "sha256:") {
		sum := sha256.Sum256([]byte(rendered))
		rendered = "sha256:" + hex.EncodeToString(sum[:])
	}
	return prefix + "{" + rendered + "}"
}

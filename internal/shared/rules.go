package shared

// The config rules the directives share, each one function: Validate calls
// it for every config (JSON too), and the Caddyfile parser for a literal
// value, adding the line.

import (
	"fmt"
	"strings"
)

// CheckStatus accepts an HTTP status a handler answers with: 400-599.
func CheckStatus(code int) error {
	if code < 400 || code > 599 {
		return fmt.Errorf("want an HTTP status code in 400-599, got %d", code)
	}
	return nil
}

// CheckPrefix accepts a key prefix: no braces, which would break the key's
// Cluster hash tag (the handler adds it).
func CheckPrefix(p string) error {
	if strings.ContainsAny(p, "{}") {
		return fmt.Errorf("%q must not contain braces (they would break the key's Cluster hash tag; the handler adds it)", p)
	}
	return nil
}

// CheckJitter accepts the share Retry-After may be raised by: 0 to 1.
func CheckJitter(f float64) error {
	if !(f >= 0 && f <= 1) { // NaN too
		return fmt.Errorf("want a fraction between 0 and 1 (e.g. 0.2), got %v", f)
	}
	return nil
}

package redisratelimit

// The config rules of redis_ratelimit, each one function: Validate calls it
// for every config (JSON too), and the Caddyfile parser for a literal value,
// adding the line. The rules redis_ratelimit shares with the other
// directives (status, prefix, jitter, key, the connection) are
// internal/shared's; those of an algorithm's rates are the engine's
// (Algorithm.CheckRate).

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
)

// checkRate accepts a rate: its placeholders are Caddy's, and its literal n
// and window make a rate algorithm a keeps (nil: the rule of every
// algorithm). A placeholder is checked when a request renders it.
func checkRate(r Rate, a ratelimit.Algorithm) error {
	if err := errors.Join(shared.CheckTemplate(r.requestsTmpl), shared.CheckTemplate(r.windowTmpl)); err != nil {
		return err
	}
	lit := ratelimit.Rate{N: int64(r.Requests), Window: time.Duration(r.Window)}
	if r.requestsTmpl != "" {
		lit.N = 1
	}
	if r.windowTmpl != "" {
		lit.Window = time.Second
	}
	if a == nil {
		return ratelimit.CheckRate(lit)
	}
	return a.CheckRate(lit)
}

// checkAlgorithm accepts an algorithm's name ("" is the default).
func checkAlgorithm(name string) error {
	_, err := ratelimit.AlgorithmNamed(name)
	return err
}

// checkBurst accepts a burst: none (0), or at least 1 with an algorithm
// that takes one.
func checkBurst(burst int, a ratelimit.Algorithm) error {
	var with []string
	for _, b := range ratelimit.Algorithms() {
		if b.HasBurst() {
			with = append(with, b.Name())
		}
	}
	switch {
	case burst < 0:
		return fmt.Errorf("must be positive, got %d", burst)
	case burst > 0 && !a.HasBurst():
		return fmt.Errorf("only valid with algorithm %s", strings.Join(with, " or "))
	}
	return nil
}

// checkCost accepts a cost: none (1), a placeholder Caddy knows, or a
// whole number of at least 1.
func checkCost(c string) error {
	if err := shared.CheckTemplate(c); err != nil {
		return err
	}
	if c == "" || redisconn.HasPlaceholder(c) {
		return nil
	}
	if n, err := strconv.ParseInt(c, 10, 64); err != nil || n < 1 {
		return fmt.Errorf("want a whole number >= 1 or a placeholder, got %q", c)
	}
	return nil
}

// checkCount accepts the statuses that count: codes in 100-599 or classes
// such as 5xx (parseStatusSet).
func checkCount(args []string) error {
	_, err := parseStatusSet(args)
	return err
}

// checkWait accepts how long a request may be held: 0 (reject at once) or
// more.
func checkWait(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("must not be negative, got %s", d)
	}
	return nil
}

// checkBan accepts a ban: none (0), or at least 1ms.
func checkBan(d time.Duration) error {
	if d < 0 || d > 0 && d < time.Millisecond {
		return fmt.Errorf("must be at least 1ms (or 0: no ban), got %s", d)
	}
	return nil
}

// checkFailPolicy accepts the fail policy: fail open, fail_closed or
// fail_local, one at most.
func checkFailPolicy(failLocal, failClosed bool) error {
	if failLocal && failClosed {
		return errors.New("fail_local and fail_closed cannot be combined (choose one fail policy)")
	}
	return nil
}

// checkInstances accepts N for fail_local: none (0: counted from
// heartbeats), or at least 1 with fail_local.
func checkInstances(n int, failLocal bool) error {
	switch {
	case n < 0:
		return fmt.Errorf("must be at least 1, got %d", n)
	case n > 0 && !failLocal:
		return errors.New("only valid with fail_local")
	}
	return nil
}

// checkIPPrefix accepts an ip_prefix: none, or IPv4 bits 1-32 and IPv6
// bits 1-128.
func checkIPPrefix(p []int) error {
	switch {
	case len(p) == 0:
		return nil
	case len(p) != 2:
		return fmt.Errorf("want [IPv4 bits, IPv6 bits], got %d numbers", len(p))
	case p[0] < 1 || p[0] > 32:
		return fmt.Errorf("IPv4 bits must be 1-32, got %d (0 would put every client in one bucket)", p[0])
	case p[1] < 1 || p[1] > 128:
		return fmt.Errorf("IPv6 bits must be 1-128, got %d (0 would put every client in one bucket)", p[1])
	}
	return nil
}

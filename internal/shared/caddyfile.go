package shared

// The Caddyfile syntax the directives share: the connection options, the
// options every directive has (status, prefix, name, jitter), the check
// that a single-value subdirective comes once, and the argument readers;
// each reader that takes a literal value checks it with the rule Validate
// uses, and adds the line.

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// ParseHandler reads one of the directives into its handler.
func ParseHandler[T any, P interface {
	*T
	caddyhttp.MiddlewareHandler
	caddyfile.Unmarshaler
}](h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := P(new(T))
	if err := m.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return m, nil
}

// OpenBlock consumes the directive name; options go in its block, after
// the matcher Caddy has taken.
func OpenBlock(d *caddyfile.Dispenser, dir string) error {
	d.Next()
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q (a matcher goes before the block; options go inside it)", dir, d.Val())
	}
	return nil
}

// SharedOptions points at the fields of the subdirectives both directives
// take with the same syntax and meaning.
type SharedOptions struct {
	Status *int
	Prefix *string
	Name   *string
	Jitter *float64
	Redis  *RedisConfig
}

// ParseSharedOption handles a subdirective both directives take: status,
// prefix, name, jitter and the connection options. It reports whether
// d.Val() was one of them.
func ParseSharedOption(d *caddyfile.Dispenser, dir string, o SharedOptions) (bool, error) {
	switch sub := d.Val(); sub {
	case "status":
		n, err := ParseStatus(d, dir)
		*o.Status = n
		return true, err
	case "prefix":
		v, err := OneArg(d, dir)
		switch {
		case err != nil:
		case v == "":
			// In JSON an empty prefix is the default; written out, it is a mistake.
			err = d.Errf("%s: prefix: must not be empty (leave prefix out for the default)", dir)
		case CheckPrefix(v) != nil:
			err = d.Errf("%s: prefix: %v", dir, CheckPrefix(v))
		}
		*o.Prefix = v
		return true, err
	case "name":
		v, err := ParseName(d, dir)
		*o.Name = v
		return true, err
	case "jitter":
		v, err := OneArg(d, dir)
		if err != nil {
			return true, err
		}
		f, err := strconv.ParseFloat(v, 64)
		if err == nil {
			err = CheckJitter(f)
		}
		if err != nil {
			return true, d.Errf("%s: jitter: want a fraction between 0 and 1 (e.g. 0.2), got %q", dir, v)
		}
		*o.Jitter = f
		return true, nil
	}
	return ParseRedisOption(d, dir, o.Redis)
}

// ParseRedisOption handles the connection subdirectives shared by both
// directives. It reports whether d.Val() was one of them.
//
//	redis    <address|url>...
//	cluster  <address|url>...
//	sentinel <master> <address>...
//	username <name>
//	password <secret>
//	db       <index>
//	tls      [<ca_file>]
//	tls_client_cert <cert_file> <key_file>
//	timeout  <duration>
func ParseRedisOption(d *caddyfile.Dispenser, dir string, c *RedisConfig) (bool, error) {
	sub := d.Val()
	switch sub {
	case "redis", "cluster":
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, d.Errf("%s: %s: needs at least one address", dir, sub)
		}
		for _, a := range args {
			if err := redisconn.ValidateAddress(a); err != nil {
				return true, d.Errf("%s: %s: %v", dir, sub, err)
			}
		}
		if sub == "redis" {
			c.Addresses = append(c.Addresses, args...)
		} else {
			c.Cluster = append(c.Cluster, args...)
			if _, _, err := redisconn.SplitSeeds("cluster", c.Cluster); err != nil {
				return true, d.Errf("%s: %v", dir, err)
			}
		}
	case "sentinel":
		args := d.RemainingArgs()
		if len(args) < 2 {
			return true, d.Errf("%s: sentinel: needs a master name and at least one sentinel address", dir)
		}
		for _, a := range args[1:] {
			if err := redisconn.ValidateAddress(a); err != nil {
				return true, d.Errf("%s: sentinel: %v", dir, err)
			}
		}
		c.SentinelMaster, c.Sentinels = args[0], append(c.Sentinels, args[1:]...)
		if _, _, err := redisconn.SplitSeeds("sentinel", c.Sentinels); err != nil {
			return true, d.Errf("%s: %v", dir, err)
		}
	case "username", "password":
		v, err := OneArg(d, dir)
		if err != nil {
			return true, err
		}
		if sub == "username" {
			c.Username = v
		} else {
			c.Password = v
		}
	case "db":
		v, err := OneArg(d, dir)
		if err != nil {
			return true, err
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return true, d.Errf("%s: db: want a non-negative integer, got %q", dir, v)
		}
		c.DB = n
	case "tls":
		args := d.RemainingArgs()
		if len(args) > 1 {
			return true, d.Errf("%s: tls: takes at most one argument (a CA file), got %d", dir, len(args))
		}
		c.TLS = true
		if len(args) == 1 {
			c.TLSCAFile = args[0]
		}
	case "tls_client_cert":
		args := d.RemainingArgs()
		if len(args) != 2 {
			return true, d.Errf("%s: tls_client_cert: want <cert_file> <key_file>, got %d argument(s)", dir, len(args))
		}
		c.TLS = true
		c.TLSClientCertFile, c.TLSClientKeyFile = args[0], args[1]
	case "timeout":
		v, err := ParsePositiveDuration(d, dir)
		if err != nil {
			return true, err
		}
		c.Timeout = caddy.Duration(v)
	default:
		return false, nil
	}
	if len(c.Addresses) > 0 && len(c.Cluster) > 0 || len(c.Addresses) > 0 && len(c.Sentinels) > 0 || len(c.Cluster) > 0 && len(c.Sentinels) > 0 {
		return true, d.Errf("%s: %s: redis, cluster and sentinel are mutually exclusive: use one of them", dir, sub)
	}
	return true, nil
}

// Subdirectives remembers the line of each subdirective of one block.
type Subdirectives struct {
	Repeatable []string       // the subdirectives that may come more than once
	Lines      map[string]int // the line of each subdirective seen
}

// Check fails when the current subdirective takes one value and was given
// before in the block, naming both lines.
func (s *Subdirectives) Check(d *caddyfile.Dispenser, dir string) error {
	sub := d.Val()
	if slices.Contains(s.Repeatable, sub) {
		return nil
	}
	if first, ok := s.Lines[sub]; ok {
		return d.Errf("%s: %s: given twice (first at line %d); it takes one value", dir, sub, first)
	}
	if s.Lines == nil {
		s.Lines = map[string]int{}
	}
	s.Lines[sub] = d.Line()
	return nil
}

// ParseName reads the handler's admin API name.
func ParseName(d *caddyfile.Dispenser, dir string) (string, error) {
	v, err := OneArg(d, dir)
	if err != nil {
		return "", err
	}
	if err := CheckHandlerName(v); err != nil {
		return "", d.Errf("%s: name: %v", dir, err)
	}
	return v, nil
}

// OneArg reads exactly one argument of the current subdirective.
func OneArg(d *caddyfile.Dispenser, dir string) (string, error) {
	sub := d.Val()
	args := d.RemainingArgs()
	if len(args) != 1 {
		return "", d.Errf("%s: %s: want exactly one argument, got %d", dir, sub, len(args))
	}
	return args[0], nil
}

// ParseDuration parses a Caddy duration ("500ms", "30s", "1d").
func ParseDuration(d *caddyfile.Dispenser, dir, sub, v string) (time.Duration, error) {
	dur, err := caddy.ParseDuration(v)
	if err != nil {
		return 0, d.Errf("%s: %s: invalid duration %q", dir, sub, v)
	}
	return dur, nil
}

// ParsePositiveDuration reads one argument that must be a duration > 0.
func ParsePositiveDuration(d *caddyfile.Dispenser, dir string) (time.Duration, error) {
	sub := d.Val()
	v, err := OneArg(d, dir)
	if err != nil {
		return 0, err
	}
	dur, err := ParseDuration(d, dir, sub, v)
	if err != nil {
		return 0, err
	}
	if dur <= 0 {
		return 0, d.Errf("%s: %s: must be positive, got %q", dir, sub, v)
	}
	return dur, nil
}

// ParseNonNegativeDuration reads one argument that must be a duration >= 0.
func ParseNonNegativeDuration(d *caddyfile.Dispenser, dir string) (time.Duration, error) {
	sub := d.Val()
	v, err := OneArg(d, dir)
	if err != nil {
		return 0, err
	}
	dur, err := ParseDuration(d, dir, sub, v)
	if err != nil {
		return 0, err
	}
	if dur < 0 {
		return 0, d.Errf("%s: %s: must not be negative, got %q", dir, sub, v)
	}
	return dur, nil
}

// ParseOnOff reads one argument that is "on" or "off".
func ParseOnOff(d *caddyfile.Dispenser, dir string) (bool, error) {
	sub := d.Val()
	v, err := OneArg(d, dir)
	if err != nil {
		return false, err
	}
	switch strings.ToLower(v) {
	case "on":
		return true, nil
	case "off":
		return false, nil
	}
	return false, d.Errf("%s: %s: want on or off, got %q", dir, sub, v)
}

// ParseStatus reads one HTTP status code in 400–599.
func ParseStatus(d *caddyfile.Dispenser, dir string) (int, error) {
	sub := d.Val()
	v, err := OneArg(d, dir)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(v)
	if err == nil {
		err = CheckStatus(n)
	}
	if err != nil {
		return 0, d.Errf("%s: %s: want an HTTP status code in 400-599, got %q", dir, sub, v)
	}
	return n, nil
}

// ParsePositiveInt reads one integer argument ≥ min.
func ParsePositiveInt(d *caddyfile.Dispenser, dir string, min int) (int, error) {
	sub := d.Val()
	v, err := OneArg(d, dir)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < min {
		return 0, d.Errf("%s: %s: want an integer >= %d, got %q", dir, sub, min, v)
	}
	return n, nil
}

// ExpandShorthands turns Caddyfile shorthands such as {client_ip} or
// {header.X} into full placeholders, so JSON configs may use them too.
func ExpandShorthands(s string) string {
	if !strings.Contains(s, "{") {
		return s
	}
	seg := caddyfile.Segment{caddyfile.Token{Text: s}}
	httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&seg)
	return seg[0].Text
}

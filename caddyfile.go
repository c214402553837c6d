package redisdlm

import (
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseRedisOption handles the connection subdirectives shared by both
// directives (SPEC §2). It reports whether d.Val() was one of them.
//
//	redis    <address|url>...
//	cluster  <address|url>...
//	sentinel <master> <address>...
//	username <name>
//	password <secret>
//	db       <index>
//	tls      [<ca_file>]
//	timeout  <duration>
func parseRedisOption(d *caddyfile.Dispenser, dir string, c *RedisConfig) (bool, error) {
	sub := d.Val()
	switch sub {
	case "redis", "cluster":
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, d.Errf("%s: %s: needs at least one address", dir, sub)
		}
		for _, a := range args {
			if err := validateAddress(a); err != nil {
				return true, d.Errf("%s: %s: %v", dir, sub, err)
			}
		}
		if sub == "redis" {
			c.Addresses = append(c.Addresses, args...)
		} else {
			c.Cluster = append(c.Cluster, args...)
		}
	case "sentinel":
		args := d.RemainingArgs()
		if len(args) < 2 {
			return true, d.Errf("%s: sentinel: needs a master name and at least one sentinel address", dir)
		}
		for _, a := range args[1:] {
			if err := validateAddress(a); err != nil {
				return true, d.Errf("%s: sentinel: %v", dir, err)
			}
		}
		c.SentinelMaster, c.Sentinels = args[0], append(c.Sentinels, args[1:]...)
	case "username", "password":
		v, err := oneArg(d, dir)
		if err != nil {
			return true, err
		}
		if sub == "username" {
			c.Username = v
		} else {
			c.Password = v
		}
	case "db":
		v, err := oneArg(d, dir)
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
	case "timeout":
		v, err := parsePositiveDuration(d, dir)
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

// oneArg reads exactly one argument of the current subdirective.
func oneArg(d *caddyfile.Dispenser, dir string) (string, error) {
	sub := d.Val()
	args := d.RemainingArgs()
	if len(args) != 1 {
		return "", d.Errf("%s: %s: want exactly one argument, got %d", dir, sub, len(args))
	}
	return args[0], nil
}

// parseDuration parses a Caddy duration ("500ms", "30s", "1d").
func parseDuration(d *caddyfile.Dispenser, dir, sub, v string) (time.Duration, error) {
	dur, err := caddy.ParseDuration(v)
	if err != nil {
		return 0, d.Errf("%s: %s: invalid duration %q", dir, sub, v)
	}
	return dur, nil
}

// parsePositiveDuration reads one argument that must be a duration > 0.
func parsePositiveDuration(d *caddyfile.Dispenser, dir string) (time.Duration, error) {
	sub := d.Val()
	v, err := oneArg(d, dir)
	if err != nil {
		return 0, err
	}
	dur, err := parseDuration(d, dir, sub, v)
	if err != nil {
		return 0, err
	}
	if dur <= 0 {
		return 0, d.Errf("%s: %s: must be positive, got %q", dir, sub, v)
	}
	return dur, nil
}

// parseOnOff reads one argument that is "on" or "off".
func parseOnOff(d *caddyfile.Dispenser, dir string) (bool, error) {
	sub := d.Val()
	v, err := oneArg(d, dir)
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

// parseStatus reads one HTTP status code in 400–599.
func parseStatus(d *caddyfile.Dispenser, dir string) (int, error) {
	sub := d.Val()
	v, err := oneArg(d, dir)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 400 || n > 599 {
		return 0, d.Errf("%s: %s: want an HTTP status code in 400-599, got %q", dir, sub, v)
	}
	return n, nil
}

// parsePositiveInt reads one integer argument ≥ min.
func parsePositiveInt(d *caddyfile.Dispenser, dir string, min int) (int, error) {
	sub := d.Val()
	v, err := oneArg(d, dir)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < min {
		return 0, d.Errf("%s: %s: want an integer >= %d, got %q", dir, sub, min, v)
	}
	return n, nil
}

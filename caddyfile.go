package redisdlm

import (
	"errors"
	"fmt"
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

func init() {
	httpcaddyfile.RegisterHandlerDirective("redis_lock", parseHandler[RedisLock])
	// The lock wraps everything after it (handle, route, reverse_proxy,
	// ...); encode wraps the lock, so a replayed answer is compressed for
	// the client it answers, not stored compressed.
	httpcaddyfile.RegisterDirectiveOrder("redis_lock", httpcaddyfile.After, "encode")
	httpcaddyfile.RegisterHandlerDirective("redis_ratelimit", parseHandler[RedisRateLimit])
	// After authentication, so {http.auth.user.id} is known.
	httpcaddyfile.RegisterDirectiveOrder("redis_ratelimit", httpcaddyfile.After, "forward_auth")
	// Right before the upstream handlers (after redis_lock, which sets the
	// token on a one-tier route).
	httpcaddyfile.RegisterHandlerDirective("redis_fence", parseHandler[RedisFence])
	httpcaddyfile.RegisterDirectiveOrder("redis_fence", httpcaddyfile.Before, "push")
}

// parseHandler reads one of the directives into its handler.
func parseHandler[T any, P interface {
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

// openBlock consumes the directive name; options go in its block, after
// the matcher Caddy has taken.
func openBlock(d *caddyfile.Dispenser, dir string) error {
	d.Next()
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q (a matcher goes before the block; options go inside it)", dir, d.Val())
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	redis_fence [<matcher>] {
//		key    <template>   # the lock's key; default {http.request.uri.path}
//		token  <template>   # default {http.request.header.Lock-Fencing-Token}
//		status <code>       # stale or missing token; default 409
//		retain <duration>   # how long the highest token is kept; default 24h
//		prefix <string>     # default caddy:fence:
//		name   <string>
//		redis | cluster | sentinel ... and the other connection options
//	}
func (h *RedisFence) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const dir = "redis_fence"
	if err := openBlock(d, dir); err != nil {
		return err
	}
	seen := subdirectives{repeatable: []string{"cluster"}}
	var jitter float64 // not an option of redis_fence
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if err := seen.check(d, dir); err != nil {
			return err
		}
		switch sub {
		case "key", "token":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			check, field := checkKeyTemplate, &h.Key
			if sub == "token" {
				check, field = checkTemplate, &h.Token
			}
			if v == "" { // in JSON the default; written out, a mistake
				return d.Errf("%s: %s: must not be empty (leave it out for the default)", dir, sub)
			}
			if err := check(v); err != nil {
				return d.Errf("%s: %s: %v", dir, sub, err)
			}
			*field = v
		case "retain":
			v, err := parsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			if v < time.Second {
				return d.Errf("%s: retain: want at least 1s, got %s", dir, v)
			}
			h.Retain = caddy.Duration(v)
		case "jitter":
			return d.Errf("%s: unknown subdirective %q", dir, sub)
		default:
			ok, err := parseSharedOption(d, dir, sharedOptions{&h.Status, &h.Prefix, &h.Name, &jitter, &h.RedisConfig})
			if err != nil {
				return err
			}
			if !ok {
				return d.Errf("%s: unknown subdirective %q", dir, sub)
			}
			if sub == "redis" && len(h.Addresses) > 1 {
				return d.Errf("%s: redis: takes exactly one address (one logical Redis; use cluster or sentinel for more), got %d", dir, len(h.Addresses))
			}
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	redis_lock [<matcher>] {
//		key            <template>      # repeatable; default {http.request.uri.path}
//		ttl            <duration>      # default 30s
//		wait           <duration>      # 0 = fail fast; default 10s
//		backoff        <min> <max>     # default 10ms 500ms
//		auto_extend    on|off          # default on
//		max_hold       <duration>      # default 0 = while the request runs
//		permits        <n>             # default 1
//		max_waiters    <n>             # default 0 = no cap
//		fencing_header <name>|off      # default Lock-Fencing-Token
//		status         <code>          # default 423
//		on_lost        cancel|continue # default cancel
//		fail_open
//		sync_replicas  <n>             # default 0
//		prefix         <string>        # default caddy:lock:
//		replay         <duration>      # execute once: keep the holder's response; default 0 = off
//		replay_max     <size>          # largest response body kept for replay; default 1MiB, at most 256MiB
//		fingerprint    off|<template>...  # what a replayed request must match; default: method, URI, body SHA-256, credentials
//		credential_cookies <name>...   # cookies that identify the client; default none
//		lock_delay     <duration>      # after a lease ends without its holder's release, grant nobody for this long; default 0
//		jitter         <fraction>      # raise Retry-After by a random share up to this; default 0
//		name           <string>        # for the admin API; default: its position
//		redis          <address|url>...
//		cluster        <address|url>...
//		sentinel       <master> <address>...
//		username       <name>
//		password       <secret>
//		db             <index>
//		tls            [<ca_file>]
//		tls_client_cert <cert_file> <key_file>
//		timeout        <duration>      # default 500ms
//	}
func (h *RedisLock) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const dir = "redis_lock"
	if err := openBlock(d, dir); err != nil {
		return err
	}
	redisLine := 0      // line of the last `redis` subdirective, for the server count check
	var addrLines []int // the line of each of h.Addresses
	replayLine := 0     // line of `replay`, for the checks against other subdirectives
	var keyLines []int  // the line of each of h.Keys
	seen := subdirectives{repeatable: lockRepeatable}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if err := seen.check(d, dir); err != nil {
			return err
		}
		switch sub {
		case "redis":
			redisLine = d.Line()
		case "replay":
			replayLine = d.Line()
		}
		switch sub {
		case "key":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("%s: key: needs a template, e.g. {http.request.header.X-User-ID}", dir)
			}
			for _, a := range args {
				if err := checkKeyTemplate(a); err != nil {
					return d.Errf("%s: key: %v", dir, err)
				}
				keyLines = append(keyLines, d.Line())
			}
			h.Keys = append(h.Keys, args...)
		case "ttl":
			v, err := parsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			h.TTL = caddy.Duration(v)
		case "wait":
			dur, err := parseNonNegativeDuration(d, dir)
			if err != nil {
				return err
			}
			cd := caddy.Duration(dur)
			h.Wait = &cd
		case "backoff":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("%s: backoff: want <min> <max>, got %d arguments", dir, len(args))
			}
			lo, err := parseDuration(d, dir, sub, args[0])
			if err != nil {
				return err
			}
			hi, err := parseDuration(d, dir, sub, args[1])
			if err != nil {
				return err
			}
			if lo <= 0 || hi <= 0 {
				return d.Errf("%s: backoff: durations must be positive", dir)
			}
			if hi < lo {
				return d.Errf("%s: backoff: max %s is below min %s", dir, args[1], args[0])
			}
			h.BackoffMin, h.BackoffMax = caddy.Duration(lo), caddy.Duration(hi)
		case "auto_extend":
			on, err := parseOnOff(d, dir)
			if err != nil {
				return err
			}
			h.AutoExtend = &on
		case "max_hold":
			v, err := parsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			h.MaxHold = caddy.Duration(v)
		case "lock_delay":
			v, err := parseNonNegativeDuration(d, dir)
			if err != nil {
				return err
			}
			h.LockDelay = caddy.Duration(v)
		case "permits":
			n, err := parsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Permits = n
		case "max_waiters":
			n, err := parsePositiveInt(d, dir, 0)
			if err != nil {
				return err
			}
			h.MaxWaiters = n
		case "fencing_header":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			if v == "" { // in JSON the default; written out, a mistake
				return d.Errf("%s: fencing_header: must not be empty (leave it out for the default, or off for none)", dir)
			}
			h.FencingHeader = v // checked at the end of the block, against the keys and fingerprint
		case "on_lost":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			if v != "cancel" && v != "continue" {
				return d.Errf("%s: on_lost: want cancel or continue, got %q", dir, v)
			}
			h.OnLost = v
		case "fail_open":
			if d.NextArg() {
				return d.Errf("%s: fail_open: takes no argument, got %q", dir, d.Val())
			}
			h.FailOpen = true
		case "sync_replicas":
			n, err := parsePositiveInt(d, dir, 0)
			if err != nil {
				return err
			}
			h.SyncReplicas = n
		case "replay":
			v, err := parsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			if v < time.Millisecond {
				return d.Errf("%s: replay: %v is less than 1ms, Redis's finest expiry", dir, v)
			}
			h.Replay = caddy.Duration(v)
		case "replay_max":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			n, err := parseSize(v)
			if err == nil {
				err = checkReplayMax(n)
			}
			if err != nil {
				return d.Errf("%s: replay_max: %v", dir, err)
			}
			h.ReplayMax = n
		case "fingerprint":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("%s: fingerprint: want off or one or more templates", dir)
			}
			if len(args) > 1 && slices.Contains(args, "off") {
				return d.Errf("%s: fingerprint: off stands alone", dir)
			}
			for _, a := range args {
				if err := checkTemplate(a); err != nil {
					return d.Errf("%s: fingerprint: %v", dir, err)
				}
			}
			h.Fingerprint = args
		case "credential_cookies":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("%s: credential_cookies: want one or more cookie names", dir)
			}
			h.CredentialCookies = append(h.CredentialCookies, args...)
		default:
			ok, err := parseSharedOption(d, dir, sharedOptions{&h.Status, &h.Prefix, &h.Name, &h.Jitter, &h.RedisConfig})
			if err != nil {
				return err
			}
			if !ok {
				return d.Errf("%s: unknown subdirective %q", dir, sub)
			}
			if sub == "redis" {
				for len(addrLines) < len(h.Addresses) {
					addrLines = append(addrLines, d.Line())
				}
				if i, j := redisconn.SameServer(h.Addresses); j >= 0 {
					err := redisconn.DuplicateServerError(h.Addresses[i], h.Addresses[j])
					if addrLines[i] != addrLines[j] {
						return d.Errf("%s: %v (the first is at line %d)", dir, err, addrLines[i])
					}
					return d.Errf("%s: %v", dir, err)
				}
			}
		}
	}
	if err := h.checkFencingHeader(); err != nil {
		return fmt.Errorf("%s: %v, at %s:%d", dir, err, d.File(), fencingHeaderLine(err, seen.lines, keyLines))
	}
	if h.Permits > 1 && len(h.Addresses) > 1 {
		return fmt.Errorf("%s: permits: %d permits cannot be used with a Redlock quorum of %d servers (holders granted by different majorities could be more than the permits); use one Redis for a semaphore, at %s:%d", dir, h.Permits, len(h.Addresses), d.File(), redisLine)
	}
	if h.Replay > 0 {
		var why string
		switch {
		case h.Permits > 1:
			why = fmt.Sprintf("cannot be used with permits %d: several holders at once would each run the route", h.Permits)
		case len(h.Keys) > 1:
			why = "takes one key template: the stored answer belongs to one lock key"
		case len(h.Addresses) > 1:
			why = "needs one Redis (a server, a Cluster or a Sentinel), not a Redlock quorum"
		}
		if why != "" {
			return fmt.Errorf("%s: replay: %s, at %s:%d", dir, why, d.File(), replayLine)
		}
	}
	if n := len(h.Addresses); n > 1 && (n%2 == 0 || n > 7) {
		return fmt.Errorf("%s: redis: %d servers given; a Redlock quorum needs an odd count of 1, 3, 5 or 7 servers, because with an even count a split in half leaves no majority, at %s:%d", dir, n, d.File(), redisLine)
	}
	return nil
}

// fencingHeaderLine is the Caddyfile line of a refused fencing header:
// fencing_header's, else that of what reads the default header.
func fencingHeaderLine(err error, lines map[string]int, keyLines []int) int {
	var fe *fencingHeaderError
	switch {
	case lines["fencing_header"] > 0 || !errors.As(err, &fe):
		return lines["fencing_header"]
	case fe.sub == "key" && fe.key < len(keyLines):
		return keyLines[fe.key]
	}
	return lines[fe.sub]
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	redis_ratelimit [<matcher>] {
//		key       <template>          # default {client_ip}; an empty render falls back to it
//		rate      <n> <window>        # repeatable; every rate must admit the request
//		algorithm sliding_window|gcra # default sliding_window
//		burst     <n>                 # gcra only; default n
//		status    <code>              # default 429, with Retry-After
//		headers   on|off              # RateLimit headers; default on
//		dry_run                       # decide, count and send headers, but never reject
//		fail_closed                   # Redis unreachable: 503 (default: admit and log)
//		fail_local                    # Redis unreachable: enforce ceil(n ÷ N) on each instance
//		instances <n>                 # N for fail_local; default: counted from heartbeats
//		prefix    <string>            # default "caddy:rl:"
//		cost      <n>                 # what one request counts for; a number or a placeholder; default 1
//		count     <status>...         # count only these answers (codes like 401, classes like 5xx); default all
//		wait      <duration>          # hold a request up to this long for its slot instead of rejecting; default 0
//		ban       <duration>          # a key its quota rejects stays rejected this long, on every rate; default 0
//		jitter    <fraction>          # raise Retry-After by a random share up to this; default 0
//		ip_prefix <v4> <v6>           # group client IPs by network prefix; default 32 128
//		name      <string>            # for the admin API; default: its position
//
//		redis    <address|url>        # one logical Redis: one address,
//		cluster  <address|url>...     # or a cluster,
//		sentinel <master> <address>...# or a sentinel group
//		username <name>
//		password <secret>
//		db       <index>
//		tls      [<ca_file>]
//		tls_client_cert <cert_file> <key_file>
//		timeout  <duration>           # default 500ms
//	}
//
// In rate, n and window may be placeholders (e.g. {plan_rpm} set by a map),
// rendered per request; so may cost. Literal values are checked here, with
// the Caddyfile line; placeholders when a request renders them.
func (h *RedisRateLimit) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const dir = "redis_ratelimit"
	if err := openBlock(d, dir); err != nil {
		return err
	}
	// Checks that depend on a later subdirective (algorithm) are made at the
	// end of the block, with the line of the subdirective they concern.
	var slidingErr, gcraErr, burstErr, instancesErr error
	seen := subdirectives{repeatable: rateLimitRepeatable}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if err := seen.check(d, dir); err != nil {
			return err
		}
		switch sub {
		case "key":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			if err := checkKeyTemplate(expandShorthands(v)); err != nil {
				return d.Errf("%s: key: %v", dir, err)
			}
			h.Key = v
		case "rate":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("%s: rate: want <n> <window>, e.g. rate 100 1m; got %d argument(s)", dir, len(args))
			}
			rate, err := RateOf(args[0], args[1])
			if err == nil {
				err = errors.Join(checkTemplate(args[0]), checkTemplate(args[1]))
			}
			if err != nil {
				return d.Errf("%s: rate: %v", dir, err)
			}
			if rate.requestsTmpl == "" && rate.Requests < 1 {
				return d.Errf("%s: rate: the request count must be an integer >= 1, got %q", dir, args[0])
			}
			// A placeholder is checked per request; literals here.
			n, win := int64(rate.Requests), time.Duration(rate.Window)
			if rate.requestsTmpl != "" {
				n = 1
			}
			if rate.windowTmpl != "" {
				win = time.Second
			}
			if err := checkRate(n, win, ""); err != nil {
				return d.Errf("%s: rate: %v", dir, err)
			}
			if err := checkRate(n, win, algoSliding); err != nil && slidingErr == nil {
				slidingErr = d.Errf("%s: rate: %v", dir, err)
			}
			if err := checkRate(n, win, algoGCRA); err != nil && gcraErr == nil {
				gcraErr = d.Errf("%s: rate: %v", dir, err)
			}
			h.Rates = append(h.Rates, rate)
		case "cost":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			if err := checkTemplate(v); err != nil {
				return d.Errf("%s: cost: %v", dir, err)
			}
			if !redisconn.HasPlaceholder(v) {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil || n < 1 {
					return d.Errf("%s: cost: want a whole number >= 1 or a placeholder, got %q", dir, v)
				}
				v = strconv.FormatInt(n, 10) // "007" and "+5" are not JSON numbers
			}
			h.Cost = IntOrPlaceholder(v)
		case "count":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("%s: count: needs at least one status code or class, e.g. count 401 403 or count 5xx", dir)
			}
			if _, err := parseStatusSet(args); err != nil {
				return d.Errf("%s: count: %v", dir, err)
			}
			h.Count = append(h.Count, args...)
		case "wait":
			dur, err := parseNonNegativeDuration(d, dir)
			if err != nil {
				return err
			}
			h.Wait = caddy.Duration(dur)
		case "ban":
			dur, err := parsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			if dur < time.Millisecond {
				return d.Errf("%s: ban: must be at least 1ms, got %s", dir, dur)
			}
			h.Ban = caddy.Duration(dur)
		case "algorithm":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			v = strings.ToLower(v)
			if v != algoSliding && v != algoGCRA {
				return d.Errf("%s: algorithm: want sliding_window or gcra, got %q", dir, v)
			}
			h.Algorithm = v
		case "burst":
			n, err := parsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Burst = n
			burstErr = d.Errf("%s: burst: only valid with algorithm gcra", dir)
		case "headers":
			on, err := parseOnOff(d, dir)
			if err != nil {
				return err
			}
			h.Headers = &on
		case "dry_run", "fail_closed", "fail_local":
			if d.NextArg() {
				return d.Errf("%s: %s: takes no arguments, got %q", dir, sub, d.Val())
			}
			switch sub {
			case "dry_run":
				h.DryRun = true
			case "fail_closed":
				h.FailClosed = true
			default:
				h.FailLocal = true
			}
			if h.FailLocal && h.FailClosed {
				return d.Errf("%s: %s: fail_local and fail_closed cannot be combined (choose one fail policy)", dir, sub)
			}
		case "instances":
			n, err := parsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Instances = n
			instancesErr = d.Errf("%s: instances: only valid with fail_local", dir)
		case "ip_prefix":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("%s: ip_prefix: want <IPv4 bits> <IPv6 bits>, e.g. ip_prefix 24 64; got %d argument(s)", dir, len(args))
			}
			v4, err4 := strconv.Atoi(args[0])
			v6, err6 := strconv.Atoi(args[1])
			if err := checkIPPrefix([]int{v4, v6}); err4 != nil || err6 != nil || err != nil {
				return d.Errf("%s: ip_prefix: want <IPv4 bits 1-32> <IPv6 bits 1-128>, got %q %q", dir, args[0], args[1])
			}
			h.IPPrefix = []int{v4, v6}
		default:
			ok, err := parseSharedOption(d, dir, sharedOptions{&h.Status, &h.Prefix, &h.Name, &h.Jitter, &h.RedisConfig})
			if err != nil {
				return err
			}
			if !ok {
				return d.Errf("%s: unknown subdirective %q", dir, sub)
			}
			if sub == "redis" && len(h.Addresses) > 1 {
				return d.Errf("%s: redis: takes exactly one address (one logical Redis; use cluster or sentinel for more), got %d", dir, len(h.Addresses))
			}
		}
	}
	if len(h.Rates) == 0 {
		return d.Errf("%s: at least one rate <n> <window> is required", dir)
	}
	if h.Algorithm == algoGCRA {
		return gcraErr
	}
	if burstErr != nil {
		return burstErr
	}
	if instancesErr != nil && !h.FailLocal {
		return instancesErr
	}
	return slidingErr
}

// sharedOptions points at the fields of the subdirectives both directives
// take with the same syntax and meaning.
type sharedOptions struct {
	status *int
	prefix *string
	name   *string
	jitter *float64
	redis  *RedisConfig
}

// parseSharedOption handles a subdirective both directives take: status,
// prefix, name, jitter and the connection options. It reports whether
// d.Val() was one of them.
func parseSharedOption(d *caddyfile.Dispenser, dir string, o sharedOptions) (bool, error) {
	switch sub := d.Val(); sub {
	case "status":
		n, err := parseStatus(d, dir)
		*o.status = n
		return true, err
	case "prefix":
		v, err := oneArg(d, dir)
		switch {
		case err != nil:
		case v == "":
			// In JSON an empty prefix is the default; written out, it is a mistake.
			err = d.Errf("%s: prefix: must not be empty (leave prefix out for the default)", dir)
		case strings.ContainsAny(v, "{}"):
			err = d.Errf("%s: prefix: %q must not contain braces (they would break the key's Cluster hash tag; the handler adds it)", dir, v)
		}
		*o.prefix = v
		return true, err
	case "name":
		v, err := parseName(d, dir)
		*o.name = v
		return true, err
	case "jitter":
		v, err := oneArg(d, dir)
		if err != nil {
			return true, err
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || !(f >= 0 && f <= 1) { // NaN too
			return true, d.Errf("%s: jitter: want a fraction between 0 and 1 (e.g. 0.2), got %q", dir, v)
		}
		*o.jitter = f
		return true, nil
	}
	return parseRedisOption(d, dir, o.redis)
}

// parseRedisOption handles the connection subdirectives shared by both
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
func parseRedisOption(d *caddyfile.Dispenser, dir string, c *RedisConfig) (bool, error) {
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
	case "tls_client_cert":
		args := d.RemainingArgs()
		if len(args) != 2 {
			return true, d.Errf("%s: tls_client_cert: want <cert_file> <key_file>, got %d argument(s)", dir, len(args))
		}
		c.TLS = true
		c.TLSClientCertFile, c.TLSClientKeyFile = args[0], args[1]
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

// The subdirectives that may be given more than once (they add to a
// list); every other one takes one value, and a second is an error rather
// than a silent "last one wins".
var (
	lockRepeatable      = []string{"key", "redis", "cluster", "credential_cookies"}
	rateLimitRepeatable = []string{"rate", "count", "redis", "cluster"} // redis: "takes exactly one address" says more
)

// subdirectives remembers the line of each subdirective of one block.
type subdirectives struct {
	repeatable []string
	lines      map[string]int
}

// check fails when the current subdirective takes one value and was given
// before in the block, naming both lines.
func (s *subdirectives) check(d *caddyfile.Dispenser, dir string) error {
	sub := d.Val()
	if slices.Contains(s.repeatable, sub) {
		return nil
	}
	if first, ok := s.lines[sub]; ok {
		return d.Errf("%s: %s: given twice (first at line %d); it takes one value", dir, sub, first)
	}
	if s.lines == nil {
		s.lines = map[string]int{}
	}
	s.lines[sub] = d.Line()
	return nil
}

// parseName reads the handler's admin API name.
func parseName(d *caddyfile.Dispenser, dir string) (string, error) {
	v, err := oneArg(d, dir)
	if err != nil {
		return "", err
	}
	if err := checkHandlerName(v); err != nil {
		return "", d.Errf("%s: name: %v", dir, err)
	}
	return v, nil
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

// parseNonNegativeDuration reads one argument that must be a duration >= 0.
func parseNonNegativeDuration(d *caddyfile.Dispenser, dir string) (time.Duration, error) {
	sub := d.Val()
	v, err := oneArg(d, dir)
	if err != nil {
		return 0, err
	}
	dur, err := parseDuration(d, dir, sub, v)
	if err != nil {
		return 0, err
	}
	if dur < 0 {
		return 0, d.Errf("%s: %s: must not be negative, got %q", dir, sub, v)
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

// expandShorthands turns Caddyfile shorthands such as {client_ip} or
// {header.X} into full placeholders, so JSON configs may use them too.
func expandShorthands(s string) string {
	if !strings.Contains(s, "{") {
		return s
	}
	seg := caddyfile.Segment{caddyfile.Token{Text: s}}
	httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&seg)
	return seg[0].Text
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*RedisFence)(nil)
	_ caddyfile.Unmarshaler = (*RedisLock)(nil)
	_ caddyfile.Unmarshaler = (*RedisRateLimit)(nil)
)

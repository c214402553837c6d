package redisdlm

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("redis_lock", shared.ParseHandler[RedisLock])
	// The lock wraps everything after it (handle, route, reverse_proxy,
	// ...); encode wraps the lock, so a replayed answer is compressed for
	// the client it answers, not stored compressed.
	httpcaddyfile.RegisterDirectiveOrder("redis_lock", httpcaddyfile.After, "encode")
	httpcaddyfile.RegisterHandlerDirective("redis_ratelimit", shared.ParseHandler[RedisRateLimit])
	// After authentication, so {http.auth.user.id} is known.
	httpcaddyfile.RegisterDirectiveOrder("redis_ratelimit", httpcaddyfile.After, "forward_auth")
	// Right before the upstream handlers (after redis_lock, which sets the
	// token on a one-tier route).
	httpcaddyfile.RegisterHandlerDirective("redis_fence", shared.ParseHandler[RedisFence])
	httpcaddyfile.RegisterDirectiveOrder("redis_fence", httpcaddyfile.Before, "push")
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
	if err := shared.OpenBlock(d, dir); err != nil {
		return err
	}
	seen := shared.Subdirectives{Repeatable: []string{"cluster"}}
	var jitter float64 // not an option of redis_fence
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if err := seen.Check(d, dir); err != nil {
			return err
		}
		switch sub {
		case "key", "token":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			check, field := shared.CheckKeyTemplate, &h.Key
			if sub == "token" {
				check, field = shared.CheckTemplate, &h.Token
			}
			if v == "" { // in JSON the default; written out, a mistake
				return d.Errf("%s: %s: must not be empty (leave it out for the default)", dir, sub)
			}
			if err := check(v); err != nil {
				return d.Errf("%s: %s: %v", dir, sub, err)
			}
			*field = v
		case "retain":
			v, err := shared.ParsePositiveDuration(d, dir)
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
			ok, err := shared.ParseSharedOption(d, dir, shared.SharedOptions{Status: &h.Status, Prefix: &h.Prefix, Name: &h.Name, Jitter: &jitter, Redis: &h.RedisConfig})
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
	if err := shared.OpenBlock(d, dir); err != nil {
		return err
	}
	redisLine := 0      // line of the last `redis` subdirective, for the server count check
	var addrLines []int // the line of each of h.Addresses
	replayLine := 0     // line of `replay`, for the checks against other subdirectives
	var keyLines []int  // the line of each of h.Keys
	seen := shared.Subdirectives{Repeatable: lockRepeatable}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if err := seen.Check(d, dir); err != nil {
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
				if err := shared.CheckKeyTemplate(a); err != nil {
					return d.Errf("%s: key: %v", dir, err)
				}
				keyLines = append(keyLines, d.Line())
			}
			h.Keys = append(h.Keys, args...)
		case "ttl":
			v, err := shared.ParsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			h.TTL = caddy.Duration(v)
		case "wait":
			dur, err := shared.ParseNonNegativeDuration(d, dir)
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
			lo, err := shared.ParseDuration(d, dir, sub, args[0])
			if err != nil {
				return err
			}
			hi, err := shared.ParseDuration(d, dir, sub, args[1])
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
			on, err := shared.ParseOnOff(d, dir)
			if err != nil {
				return err
			}
			h.AutoExtend = &on
		case "max_hold":
			v, err := shared.ParsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			h.MaxHold = caddy.Duration(v)
		case "lock_delay":
			v, err := shared.ParseNonNegativeDuration(d, dir)
			if err != nil {
				return err
			}
			h.LockDelay = caddy.Duration(v)
		case "permits":
			n, err := shared.ParsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Permits = n
		case "max_waiters":
			n, err := shared.ParsePositiveInt(d, dir, 0)
			if err != nil {
				return err
			}
			h.MaxWaiters = n
		case "fencing_header":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			if v == "" { // in JSON the default; written out, a mistake
				return d.Errf("%s: fencing_header: must not be empty (leave it out for the default, or off for none)", dir)
			}
			h.FencingHeader = v // checked at the end of the block, against the keys and fingerprint
		case "on_lost":
			v, err := shared.OneArg(d, dir)
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
			n, err := shared.ParsePositiveInt(d, dir, 0)
			if err != nil {
				return err
			}
			h.SyncReplicas = n
		case "replay":
			v, err := shared.ParsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			if v < time.Millisecond {
				return d.Errf("%s: replay: %v is less than 1ms, Redis's finest expiry", dir, v)
			}
			h.Replay = caddy.Duration(v)
		case "replay_max":
			v, err := shared.OneArg(d, dir)
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
				if err := shared.CheckTemplate(a); err != nil {
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
			ok, err := shared.ParseSharedOption(d, dir, shared.SharedOptions{Status: &h.Status, Prefix: &h.Prefix, Name: &h.Name, Jitter: &h.Jitter, Redis: &h.RedisConfig})
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
		return fmt.Errorf("%s: %v, at %s:%d", dir, err, d.File(), fencingHeaderLine(err, seen.Lines, keyLines))
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
	if err := shared.OpenBlock(d, dir); err != nil {
		return err
	}
	// Checks that depend on a later subdirective (algorithm) are made at the
	// end of the block, with the line of the subdirective they concern.
	var slidingErr, gcraErr, burstErr, instancesErr error
	seen := shared.Subdirectives{Repeatable: rateLimitRepeatable}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if err := seen.Check(d, dir); err != nil {
			return err
		}
		switch sub {
		case "key":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			if err := shared.CheckKeyTemplate(shared.ExpandShorthands(v)); err != nil {
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
				err = errors.Join(shared.CheckTemplate(args[0]), shared.CheckTemplate(args[1]))
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
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			if err := shared.CheckTemplate(v); err != nil {
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
			dur, err := shared.ParseNonNegativeDuration(d, dir)
			if err != nil {
				return err
			}
			h.Wait = caddy.Duration(dur)
		case "ban":
			dur, err := shared.ParsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			if dur < time.Millisecond {
				return d.Errf("%s: ban: must be at least 1ms, got %s", dir, dur)
			}
			h.Ban = caddy.Duration(dur)
		case "algorithm":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			v = strings.ToLower(v)
			if v != algoSliding && v != algoGCRA {
				return d.Errf("%s: algorithm: want sliding_window or gcra, got %q", dir, v)
			}
			h.Algorithm = v
		case "burst":
			n, err := shared.ParsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Burst = n
			burstErr = d.Errf("%s: burst: only valid with algorithm gcra", dir)
		case "headers":
			on, err := shared.ParseOnOff(d, dir)
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
			n, err := shared.ParsePositiveInt(d, dir, 1)
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
			ok, err := shared.ParseSharedOption(d, dir, shared.SharedOptions{Status: &h.Status, Prefix: &h.Prefix, Name: &h.Name, Jitter: &h.Jitter, Redis: &h.RedisConfig})
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

// The subdirectives that may be given more than once (they add to a
// list); every other one takes one value, and a second is an error rather
// than a silent "last one wins".
var (
	lockRepeatable      = []string{"key", "redis", "cluster", "credential_cookies"}
	rateLimitRepeatable = []string{"rate", "count", "redis", "cluster"} // redis: "takes exactly one address" says more
)

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*RedisFence)(nil)
	_ caddyfile.Unmarshaler = (*RedisLock)(nil)
	_ caddyfile.Unmarshaler = (*RedisRateLimit)(nil)
)

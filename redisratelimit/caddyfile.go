package redisratelimit

// redis_ratelimit's Caddyfile syntax.

import (
	"strconv"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("redis_ratelimit", shared.ParseHandler[RedisRateLimit])
	// After authentication, so {http.auth.user.id} is known.
	httpcaddyfile.RegisterDirectiveOrder("redis_ratelimit", httpcaddyfile.After, "forward_auth")
}

// rateLimitRepeatable are the subdirectives that may be given more than
// once; redis too, so that "takes exactly one address" can say more than
// "given twice".
var rateLimitRepeatable = []string{"rate", "count", "redis", "cluster"}

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
	// Checks that depend on a later subdirective (algorithm, fail_local)
	// are made at the end of the block, with the line of the subdirective
	// they concern: algoErrs holds each algorithm's first error of a rate
	// or the burst.
	var instancesErr error
	algoErrs := map[string]error{}
	byAlgorithm := func(sub string, check func(ratelimit.Algorithm) error) {
		for _, a := range ratelimit.Algorithms() {
			if err := check(a); err != nil && algoErrs[a.Name()] == nil {
				algoErrs[a.Name()] = d.Errf("%s: %s: %v", dir, sub, err)
			}
		}
	}
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
				err = checkRate(rate, nil)
			}
			if err != nil {
				return d.Errf("%s: rate: %v", dir, err)
			}
			byAlgorithm("rate", func(a ratelimit.Algorithm) error { return checkRate(rate, a) })
			h.Rates = append(h.Rates, rate)
		case "cost":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			if err := checkCost(v); err != nil {
				return d.Errf("%s: cost: %v", dir, err)
			}
			if n, err := strconv.ParseInt(v, 10, 64); err == nil {
				v = strconv.FormatInt(n, 10) // "007" and "+5" are not JSON numbers
			}
			h.Cost = IntOrPlaceholder(v)
		case "count":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("%s: count: needs at least one status code or class, e.g. count 401 403 or count 5xx", dir)
			}
			if err := checkCount(args); err != nil {
				return d.Errf("%s: count: %v", dir, err)
			}
			h.Count = append(h.Count, args...)
		case "wait":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			dur, err := shared.ParseDuration(d, dir, sub, v)
			if err != nil {
				return err
			}
			if err := checkWait(dur); err != nil {
				return d.Errf("%s: wait: %v", dir, err)
			}
			h.Wait = caddy.Duration(dur)
		case "ban":
			dur, err := shared.ParsePositiveDuration(d, dir)
			if err != nil {
				return err
			}
			if err := checkBan(dur); err != nil {
				return d.Errf("%s: ban: %v", dir, err)
			}
			h.Ban = caddy.Duration(dur)
		case "algorithm":
			v, err := shared.OneArg(d, dir)
			if err != nil {
				return err
			}
			v = strings.ToLower(v)
			if err := checkAlgorithm(v); err != nil {
				return d.Errf("%s: algorithm: %v", dir, err)
			}
			h.Algorithm = v
		case "burst":
			n, err := shared.ParsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Burst = n
			byAlgorithm("burst", func(a ratelimit.Algorithm) error { return checkBurst(n, a) })
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
			if err := checkFailPolicy(h.FailLocal, h.FailClosed); err != nil {
				return d.Errf("%s: %s: %v", dir, sub, err)
			}
		case "instances":
			n, err := shared.ParsePositiveInt(d, dir, 1)
			if err != nil {
				return err
			}
			h.Instances = n
			if err := checkInstances(n, false); err != nil {
				instancesErr = d.Errf("%s: instances: %v", dir, err) // unless fail_local follows
			}
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
				return d.Errf("%s: %v", dir, h.RedisConfig.Validate(false))
			}
		}
	}
	if len(h.Rates) == 0 {
		return d.Errf("%s: at least one rate <n> <window> is required", dir)
	}
	if instancesErr != nil && checkInstances(h.Instances, h.FailLocal) != nil {
		return instancesErr
	}
	algo, _ := ratelimit.AlgorithmNamed(h.Algorithm) // checked at its line
	return algoErrs[algo.Name()]
}

var _ caddyfile.Unmarshaler = (*RedisRateLimit)(nil)

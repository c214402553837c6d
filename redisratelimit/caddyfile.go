package redisratelimit

// redis_ratelimit's Caddyfile syntax.

import (
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
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
	// they concern: rateErrs holds each algorithm's first rate error.
	var burstErr, instancesErr error
	rateErrs := map[string]error{}
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
			r := ratelimit.Rate{N: n, Window: win}
			if err := ratelimit.CheckRate(r); err != nil {
				return d.Errf("%s: rate: %v", dir, err)
			}
			for _, a := range ratelimit.Algorithms() {
				if err := a.CheckRate(r); err != nil && rateErrs[a.Name()] == nil {
					rateErrs[a.Name()] = d.Errf("%s: rate: %v", dir, err)
				}
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
			if _, err := ratelimit.AlgorithmNamed(v); err != nil {
				return d.Errf("%s: algorithm: %v", dir, err)
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
	algo, _ := ratelimit.AlgorithmNamed(h.Algorithm) // checked at its line
	if burstErr != nil && !algo.HasBurst() {
		return burstErr
	}
	if instancesErr != nil && !h.FailLocal {
		return instancesErr
	}
	return rateErrs[algo.Name()]
}

var _ caddyfile.Unmarshaler = (*RedisRateLimit)(nil)

package redisdlm

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("redis_ratelimit", parseRateLimitCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("redis_ratelimit", httpcaddyfile.After, "forward_auth")
}

func parseRateLimitCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	rl := new(RedisRateLimit)
	if err := rl.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return rl, nil
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
//		prefix    <string>            # default "caddy:rl:"
//
//		redis    <address|url>        # one logical Redis: one address,
//		cluster  <address|url>...     # or a cluster,
//		sentinel <master> <address>...# or a sentinel group
//		username <name>
//		password <secret>
//		db       <index>
//		tls      [<ca_file>]
//		timeout  <duration>           # default 500ms
//	}
func (h *RedisRateLimit) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const dir = "redis_ratelimit"
	d.Next() // consume the directive name
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q (a matcher goes before the block; options go inside it)", dir, d.Val())
	}
	// Checks that depend on a later subdirective (algorithm) are made at the
	// end of the block, with the line of the subdirective they concern.
	var slidingErr, gcraErr, burstErr error
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
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
			n, err := strconv.Atoi(args[0])
			if err != nil || n < 1 {
				return d.Errf("%s: rate: the request count must be an integer >= 1, got %q", dir, args[0])
			}
			win, err := parseDuration(d, dir, sub, args[1])
			if err != nil {
				return err
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
			h.Rates = append(h.Rates, Rate{Requests: n, Window: caddy.Duration(win)})
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
		case "status":
			n, err := parseStatus(d, dir)
			if err != nil {
				return err
			}
			h.Status = n
		case "headers":
			on, err := parseOnOff(d, dir)
			if err != nil {
				return err
			}
			h.Headers = &on
		case "dry_run", "fail_closed":
			if d.NextArg() {
				return d.Errf("%s: %s: takes no arguments, got %q", dir, sub, d.Val())
			}
			if sub == "dry_run" {
				h.DryRun = true
			} else {
				h.FailClosed = true
			}
		case "prefix":
			v, err := oneArg(d, dir)
			if err != nil {
				return err
			}
			if strings.ContainsAny(v, "{}") {
				return d.Errf("%s: prefix: must not contain { or } (the handler adds the hash tag), got %q", dir, v)
			}
			h.Prefix = v
		default:
			ok, err := parseRedisOption(d, dir, &h.RedisConfig)
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
	return slidingErr
}

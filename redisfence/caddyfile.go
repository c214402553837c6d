package redisfence

// redis_fence's Caddyfile syntax.

import (
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("redis_fence", shared.ParseHandler[RedisFence])
	// Right before the upstream handlers (after redis_lock, which sets the
	// token on a one-tier route).
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
			if err := checkRetain(v); err != nil {
				return d.Errf("%s: retain: %v", dir, err)
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

var _ caddyfile.Unmarshaler = (*RedisFence)(nil)

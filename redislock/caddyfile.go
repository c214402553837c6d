package redislock

// redis_lock's Caddyfile syntax.

import (
	"errors"
	"fmt"
	"slices"
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
}

// lockRepeatable are the subdirectives that may be given more than once
// (they add to a list); every other one takes one value, and a second is
// an error rather than a silent "last one wins".
var lockRepeatable = []string{"key", "redis", "cluster", "credential_cookies"}

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

var _ caddyfile.Unmarshaler = (*RedisLock)(nil)

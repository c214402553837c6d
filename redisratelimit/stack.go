package redisratelimit

// Stacked limiters: when several redis_ratelimit handlers answer one
// request, the RateLimit-Policy entries of all of them are sent, each under
// its handler's label, and RateLimit names the tightest.
// A single handler's answer keeps its plain names ("r0"), so the common
// case costs nothing more.

import (
	"net/http"
	"strconv"
	"strings"
)

// stackVar is the request variable naming the last redis_ratelimit handler
// that set the RateLimit fields of the request.
const stackVar = "redisdlm.ratelimit_headers"

// stackHeaders merges this handler's policy (and its RateLimit field, if
// any) into the fields an earlier handler set: every entry named
// "<label>/<rate>", RateLimit the one with the least quota left (on a tie,
// the longer wait).
func stackHeaders(hdr http.Header, prevLabel, label, policy, rateLimit string) {
	old := strings.Join(hdr.Values(HeaderRateLimitPolicy), ", ")
	merged := labelEntries(old, prevLabel)
	if merged != "" {
		merged += ", "
	}
	merged += labelEntries(policy, label)
	hdr[canonRateLimitPolicy] = []string{merged}
	if rateLimit == "" {
		// No decision of this handler (its fail policy answered): the
		// earlier one's field stands, under its handler's name.
		if prev := hdr.Get(HeaderRateLimit); prev != "" {
			hdr[canonRateLimit] = []string{labelEntries(prev, prevLabel)}
		}
		return
	}
	mine := labelEntries(rateLimit, label)
	prev := hdr.Get(HeaderRateLimit)
	if prev == "" {
		hdr[canonRateLimit] = []string{mine}
		return
	}
	prev = labelEntries(prev, prevLabel)
	pr, pt := rateLimitParams(prev)
	mr, mt := rateLimitParams(mine)
	if mr < pr || (mr == pr && mt > pt) {
		prev = mine
	}
	hdr[canonRateLimit] = []string{prev}
}

// labelEntries names every entry of a field ("r0";q=5;w=60, ...) under
// label, unless it is named under a handler already.
func labelEntries(field, label string) string {
	if field == "" {
		return ""
	}
	parts := strings.Split(field, ", ")
	for i, p := range parts {
		if name, rest, ok := strings.Cut(strings.TrimPrefix(p, `"`), `"`); ok && !strings.Contains(name, "/") {
			parts[i] = `"` + label + "/" + name + `"` + rest
		}
	}
	return strings.Join(parts, ", ")
}

// rateLimitParams reads r and t of a RateLimit field.
func rateLimitParams(f string) (r, t int64) {
	for _, p := range strings.Split(f, ";") {
		if v, ok := strings.CutPrefix(p, "r="); ok {
			r, _ = strconv.ParseInt(v, 10, 64)
		} else if v, ok := strings.CutPrefix(p, "t="); ok {
			t, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	return r, t
}

package redisratelimit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// A request's plan: the rates, cost and script arguments it is decided by.
// A handler whose rates and cost are literals has one plan, made in
// Provision; one with placeholders renders a plan per request, and each
// rendered rate has its own Redis key (its n and window are in the key's
// name), so each plan keeps its own state.

// Rate is one limit: at most Requests requests per Window.
//
// In JSON, `requests` is a number (`100`) or a string holding a placeholder
// (`"{plan_rpm}"`), and `window` is a duration (`"1m"`, or nanoseconds) or a
// string holding a placeholder (`"{plan_window}"`). A placeholder is
// rendered per request, and the render is used as it is (never trimmed).
// A usable n is base-10 digits and nothing else (no sign, exponent or
// fraction), at least 1 and at most what the algorithm takes; a usable
// window is a duration of at least 1ms. Any other render is bad input: the
// request gets 400 whatever the fail policy, counts nothing in Redis, and
// the template is logged once as an error; it is never left unlimited.
type Rate struct {
	// The number of requests admitted per window. Required; at least 1.
	// With sliding_window at most 100000.
	Requests int `json:"requests"`

	// The length of the window. Required; at least 1ms.
	Window caddy.Duration `json:"window"`

	// Placeholders standing for Requests or Window (set instead of them).
	requestsTmpl string
	windowTmpl   string
}

// RateOf returns a rate whose n and window are templates (a literal or a
// placeholder each), as the Caddyfile `rate <n> <window>` gives them.
func RateOf(n, window string) (Rate, error) {
	var r Rate
	if redisconn.HasPlaceholder(n) {
		r.requestsTmpl = n
	} else {
		v, err := strconv.Atoi(n)
		if err != nil {
			return r, fmt.Errorf("the request count must be an integer >= 1 or a placeholder, got %q", n)
		}
		r.Requests = v
	}
	if redisconn.HasPlaceholder(window) {
		r.windowTmpl = window
	} else {
		d, err := caddy.ParseDuration(window)
		if err != nil {
			return r, fmt.Errorf("invalid duration %q", window)
		}
		r.Window = caddy.Duration(d)
	}
	return r, nil
}

// MarshalJSON writes placeholders as strings, literals as numbers.
func (r Rate) MarshalJSON() ([]byte, error) {
	var n, w any = r.Requests, int64(r.Window)
	if r.requestsTmpl != "" {
		n = r.requestsTmpl
	}
	if r.windowTmpl != "" {
		w = r.windowTmpl
	}
	return json.Marshal(struct {
		Requests any `json:"requests"`
		Window   any `json:"window"`
	}{n, w})
}

// UnmarshalJSON reads numbers, duration strings and placeholders.
func (r *Rate) UnmarshalJSON(b []byte) error {
	var raw struct {
		Requests json.RawMessage `json:"requests"`
		Window   json.RawMessage `json:"window"`
	}
	// Strict, as Caddy decodes every module's JSON: a misspelled or
	// misplaced field ("requets", "burst") is an error, not a default.
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return fmt.Errorf("rate: %w (a rate has only requests and window)", err)
	}
	*r = Rate{}
	if len(raw.Requests) > 0 && raw.Requests[0] == '"' {
		var s string
		if err := json.Unmarshal(raw.Requests, &s); err != nil {
			return err
		}
		v, err := RateOf(s, "1s")
		if err != nil {
			return fmt.Errorf("rate requests: %v", err)
		}
		r.Requests, r.requestsTmpl = v.Requests, v.requestsTmpl
	} else if len(raw.Requests) > 0 {
		if err := json.Unmarshal(raw.Requests, &r.Requests); err != nil {
			return fmt.Errorf("rate requests: want an integer or a placeholder string: %v", err)
		}
	}
	if len(raw.Window) > 0 && raw.Window[0] == '"' {
		var s string
		if err := json.Unmarshal(raw.Window, &s); err != nil {
			return err
		}
		if redisconn.HasPlaceholder(s) {
			r.windowTmpl = s
			return nil
		}
	}
	if len(raw.Window) > 0 {
		return r.Window.UnmarshalJSON(raw.Window)
	}
	return nil
}

// IntOrPlaceholder is a whole number, or a placeholder rendered per request.
// In JSON it is a number (`3`) or a string (`"3"`, `"{http.vars.cost}"`).
type IntOrPlaceholder string

// MarshalJSON writes a literal as a number, a placeholder as a string. A
// literal is written in its plain form: "007" or "+5" are numbers to
// strconv but not in JSON, so they become 7 and 5.
func (v IntOrPlaceholder) MarshalJSON() ([]byte, error) {
	if n, err := strconv.ParseInt(string(v), 10, 64); err == nil {
		return strconv.AppendInt(nil, n, 10), nil
	}
	return json.Marshal(string(v))
}

// UnmarshalJSON reads a JSON number or string.
func (v *IntOrPlaceholder) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*v = IntOrPlaceholder(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("want an integer or a placeholder string, got %s", b)
	}
	*v = IntOrPlaceholder(n.String())
	return nil
}

// plan is what one request is decided by: the engine's plan (its rates,
// cost and script arguments) and what the answer says of it.
type plan struct {
	*ratelimit.Plan
	policy string // the RateLimit-Policy value
	// deny is added to the deny cache's key: "" for the static plan, else
	// the rendered rates, so a deny of one plan never answers another.
	deny string
}

// rate is a rate of n per window as the handler's algorithm takes it.
func (h *RedisRateLimit) rate(n int64, window time.Duration) ratelimit.Rate {
	return ratelimit.Rate{N: n, Window: window, Burst: int64(h.Burst)}
}

// newPlan makes the plan of rates and cost, with its RateLimit-Policy.
func (h *RedisRateLimit) newPlan(rates []ratelimit.Rate, cost int64) plan {
	p := plan{Plan: h.limit.Plan(rates, cost)}
	policies := make([]string, len(p.Rates))
	for i, r := range p.Rates {
		policies[i] = fmt.Sprintf(`"r%d";q=%d;w=%d`, i, r.N, shared.CeilSeconds(r.Window))
	}
	p.policy = strings.Join(policies, ", ")
	return p
}

// errBadRender is a rate, window or cost that rendered to something
// unusable: bad input, answered 400 (never by the fail policy).
var errBadRender = errors.New("redisdlm: bad rate-limit input")

// planFor returns the plan of one request: the static one, or one rendered
// from the request's placeholders. A bad render is logged once per
// template as an error, and its error wraps errBadRender.
func (h *RedisRateLimit) planFor(repl *caddy.Replacer) (*plan, error) {
	if !h.dynamic && h.costTmpl == "" {
		return &h.static, nil
	}
	cost, rates := h.static.Cost, h.static.Rates
	if h.costTmpl != "" {
		v, err := h.renderInt(repl, "cost", h.costTmpl, h.costTmpl)
		if err != nil {
			return nil, err
		}
		cost = v
	}
	if h.dynamic {
		rates = make([]ratelimit.Rate, len(h.specs))
		for i, s := range h.specs {
			n, window := s.n, s.window
			tmpl := s.rateTemplate()
			var err error
			if s.nTmpl != "" {
				if n, err = h.renderInt(repl, "rate", tmpl, s.nTmpl); err != nil {
					return nil, err
				}
			}
			if s.wTmpl != "" {
				if window, err = h.renderDuration(repl, tmpl, s.wTmpl); err != nil {
					return nil, err
				}
			}
			rates[i] = h.rate(n, window)
			if err := h.algo.CheckRate(rates[i]); err != nil {
				return nil, h.badRender("rate", tmpl, fmt.Sprintf("%d %s", n, window), err)
			}
		}
	}
	p := h.newPlan(rates, cost)
	if h.dynamic {
		p.deny = p.ID()
	}
	return &p, nil
}

// hold is the longest a request may be held (wait), as the script takes it.
func (h *RedisRateLimit) hold() time.Duration {
	if h.DryRun {
		return 0 // a dry run never holds a request
	}
	return time.Duration(h.Wait)
}

// ban is how long a key its quota rejects stays rejected, as the script
// takes it: 0 (none) under dry_run, which never rejects.
func (h *RedisRateLimit) ban() time.Duration {
	if h.DryRun {
		return 0
	}
	return time.Duration(h.Ban)
}

// rateTemplate is the rate as written: `<n> <window>`.
func (s rateSpec) rateTemplate() string {
	n, w := s.nTmpl, s.wTmpl
	if n == "" {
		n = strconv.FormatInt(s.n, 10)
	}
	if w == "" {
		w = s.window.String()
	}
	return n + " " + w
}

// renderInt renders part of a template (of subdirective sub, logged as
// whole) that must give a usable count (see parseCount).
func (h *RedisRateLimit) renderInt(repl *caddy.Replacer, sub, whole, part string) (int64, error) {
	v, err := repl.ReplaceOrErr(part, false, true)
	if err != nil {
		return 0, h.badRender(sub, whole, "", err)
	}
	n, err := parseCount(v)
	if err != nil {
		return 0, h.badRender(sub, whole, v, err)
	}
	return n, nil
}

// parseCount reads a rendered n or cost. A usable one is base-10 digits
// and nothing else, at least 1 and within int64: no sign, exponent,
// fraction, digit separator or surrounding spaces (the render is used as
// it is, never trimmed), so `+5`, `1e3`, `5.0` and ` 5` are all bad input.
func parseCount(v string) (int64, error) {
	if v == "" {
		return 0, errors.New("empty, want a whole number >= 1")
	}
	for i := 0; i < len(v); i++ {
		if v[i] < '0' || v[i] > '9' {
			return 0, errors.New("want a whole number >= 1, in digits only")
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, errors.New("too large")
	}
	if n < 1 {
		return 0, errors.New("want a whole number >= 1")
	}
	return n, nil
}

// renderDuration renders a rate's window template: a Caddy duration
// (`90s`, `1m`, `1d`), used as it is (never trimmed).
func (h *RedisRateLimit) renderDuration(repl *caddy.Replacer, whole, part string) (time.Duration, error) {
	v, err := repl.ReplaceOrErr(part, false, true)
	if err != nil {
		return 0, h.badRender("rate", whole, "", err)
	}
	d, err := caddy.ParseDuration(v)
	if err != nil {
		return 0, h.badRender("rate", whole, v, errors.New("window: not a duration"))
	}
	return d, nil
}

// badRender logs a template's bad render (once per template) and returns
// the error of the 400 that answers it: the subdirective, its template,
// the start of what it rendered and why that is unusable.
func (h *RedisRateLimit) badRender(sub, tmpl, got string, cause error) error {
	if h.warn.First("render:" + tmpl) {
		answer := "answering 400"
		if h.DryRun {
			answer = "passing the request (dry_run)"
		}
		h.logger.Error("rate limit "+sub+" renders to an unusable value; "+answer+" (logged once per template)",
			zap.String("template", tmpl), zap.String("rendered", got), zap.Error(cause))
	}
	if len(got) > 40 {
		got = got[:40] + "..."
	}
	return fmt.Errorf("%w: %s %q rendered %q: %v", errBadRender, sub, tmpl, got, cause)
}

// badInput answers a request whose rate, window or cost rendered to
// something unusable: 400, whatever the handler's status and fail policy
// (those are for limited requests and Redis faults, not for a client's
// input), counted as bad_request; nothing is counted in Redis. Under
// dry_run the request passes.
func (h *RedisRateLimit) badInput(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, err error) error {
	h.counters[shared.ResultBadRequest].Inc()
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	return caddyhttp.Error(http.StatusBadRequest, err)
}

// statusSet is the answers that count (`count`); nil counts every answer.
type statusSet [6]uint128

// uint128 is a bit set of 100 statuses of one class.
type uint128 [2]uint64

// parseStatusSet reads `count`'s arguments: codes in 100-599, or classes
// such as 5xx.
func parseStatusSet(args []string) (*statusSet, error) {
	if len(args) == 0 {
		return nil, nil
	}
	var s statusSet
	for _, a := range args {
		a = strings.ToLower(strings.TrimSpace(a))
		if len(a) == 3 && a[1:] == "xx" && a[0] >= '1' && a[0] <= '5' {
			c := a[0] - '0'
			s[c] = uint128{^uint64(0), ^uint64(0)}
			continue
		}
		n, err := strconv.Atoi(a)
		if err != nil || n < 100 || n > 599 {
			return nil, fmt.Errorf("want status codes in 100-599 or classes such as 4xx, got %q", a)
		}
		s[n/100][n%100/64] |= 1 << (n % 100 % 64)
	}
	return &s, nil
}

// has reports whether an answer with status counts.
func (s *statusSet) has(status int) bool {
	if s == nil {
		return true
	}
	if status < 100 || status > 599 {
		return false
	}
	return s[status/100][status%100/64]&(1<<(status%100%64)) != 0
}

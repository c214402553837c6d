package redisratelimit

// The rate limiter's side of the admin API: a key's quota per rate, read
// without counting a request, and a reset of that quota.

import (
	"context"
	_ "embed"
	"encoding/binary"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"go.uber.org/zap"
)

var (
	//go:embed scripts/admin_ratelimit_peek.lua
	adminRateLimitPeekLua    string
	adminRateLimitPeekScript = redisconn.NewScript(adminRateLimitPeekLua)
)

// quotaView is one rate of a key's quota.
type quotaView struct {
	Policy    string `json:"policy"` // r0, r1, ... as in RateLimit-Policy
	Requests  int64  `json:"requests"`
	Window    string `json:"window"`
	Used      int64  `json:"used"`
	Remaining int64  `json:"remaining"`
	// Until the quota grows again (0 when it is full), in whole seconds
	// rounded up (as the RateLimit field's t) and in milliseconds.
	Reset   int64 `json:"reset"`
	ResetMs int64 `json:"reset_ms"`
	// A rate whose n or window is a placeholder (a plan) is rendered per
	// request: each rendered rate the key has state for in Redis is listed
	// with its n and window and the template it came from (policy r<i>
	// when one rate template explains it, else none); a template with no
	// state is listed with its template only.
	Template string `json:"template,omitempty"`
}

// keyTemplateText is the key template, shorthands expanded, for the admin
// API's list.
func (h *RedisRateLimit) keyTemplateText() string { return h.keyTmpl.Raw }

// adminLimitID maps the admin API's <key> to the limit id: the rendered key
// as the handler stores it, or with ?fallback=ip the client-IP fallback of
// a key that rendered empty.
func adminLimitID(r *http.Request, key string) string {
	if r.URL.Query().Get("fallback") == "ip" {
		return limitIDFor("", key)
	}
	return limitIDFor(key, "")
}

// quotaTarget is one rate state of a limit id that the admin API reads or
// resets: a literal rate of the handler, or a rendered one (a plan) found
// in Redis.
type quotaTarget struct {
	key    string
	spec   rateSpec
	policy string // r<i>; "" for a rendered rate no single rate template explains
	tmpl   string // the rate template of a rendered rate
}

// maxIndexed bounds the rendered rate states of one key the admin API
// reads from its rate index.
const maxIndexed = 1000

// quotaTargets lists the rate states of id: every literal rate, and, when
// some rate is rendered per request, every rendered rate state the key's
// rate index lists (indexKey; a missing or stale index lists nothing, or
// states that are gone). complete is false when the index lists more than
// maxIndexed states.
func (h *RedisRateLimit) quotaTargets(ctx context.Context, id string) (targets []quotaTarget, complete bool, err error) {
	var templates []int // the rates rendered per request
	for i, s := range h.static.rates {
		if s.nTmpl != "" || s.wTmpl != "" {
			templates = append(templates, i)
			continue
		}
		targets = append(targets, quotaTarget{key: h.keyHead + id + s.tail, spec: s, policy: "r" + strconv.Itoa(i)})
	}
	if len(templates) == 0 {
		return targets, true, nil
	}
	found, err := h.client.Redis.ZRange(ctx, h.indexKey(id), 0, maxIndexed).Result()
	if err != nil {
		return nil, false, err
	}
	complete = len(found) <= maxIndexed
	found = found[:min(len(found), maxIndexed)]
	slices.Sort(found)
	policy, tmpl := "", ""
	for _, i := range templates {
		if tmpl != "" {
			tmpl += ", "
		}
		tmpl += h.static.rates[i].rateTemplate()
	}
	if len(templates) == 1 {
		policy = "r" + strconv.Itoa(templates[0])
	}
	head := h.keyHead + id
	for _, k := range found {
		if !strings.HasPrefix(k, head+"}:") || slices.ContainsFunc(targets, func(t quotaTarget) bool { return t.key == k }) {
			continue // not this key's, or a literal rate's state
		}
		s, ok := h.parseRateKey(k[len(head):])
		if !ok {
			continue
		}
		targets = append(targets, quotaTarget{key: k, spec: s, policy: policy, tmpl: tmpl})
	}
	return targets, complete, nil
}

// parseRateKey reads the rate from the tail of a rate state's Redis key,
// "}:sw:<n>/<window>" or "}:gcra:<n>/<window>:b<burst>" (see newSpec),
// for this handler's algorithm.
func (h *RedisRateLimit) parseRateKey(tail string) (rateSpec, bool) {
	rest, ok := strings.CutPrefix(tail, "}:sw:")
	if h.algo == algoGCRA {
		rest, ok = strings.CutPrefix(tail, "}:gcra:")
	}
	if !ok {
		return rateSpec{}, false
	}
	nText, wText, ok := strings.Cut(rest, "/")
	if !ok {
		return rateSpec{}, false
	}
	var burst int64
	if h.algo == algoGCRA {
		var bText string
		if wText, bText, ok = strings.Cut(wText, ":b"); !ok {
			return rateSpec{}, false
		}
		var err error
		if burst, err = parseCount(bText); err != nil {
			return rateSpec{}, false
		}
	}
	n, err := parseCount(nText)
	if err != nil {
		return rateSpec{}, false
	}
	w, err := time.ParseDuration(wText)
	if err != nil || checkRate(n, w, h.algo) != nil {
		return rateSpec{}, false
	}
	s := h.newSpec(0, n, w)
	if h.algo == algoGCRA {
		s.burst = burst
	}
	if s.tail != tail {
		return rateSpec{}, false // not as this handler writes it
	}
	return s, true
}

// peekQuota reads the quota of one limit id without recording anything.
// found is false when no rate has state for it.
func (h *RedisRateLimit) peekQuota(ctx context.Context, id string) (views []quotaView, keys []string, complete, found bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	targets, complete, err := h.quotaTargets(ctx, id)
	if err != nil {
		return nil, nil, false, false, err
	}
	for _, t := range targets {
		keys = append(keys, t.key)
	}
	if len(keys) == 0 {
		return h.templateViews(nil), nil, complete, false, nil
	}
	res, err := adminRateLimitPeekScript.Run(ctx, h.client.Redis, keys).Slice()
	if err != nil {
		return nil, nil, false, false, err
	}
	if len(res) != 2+len(keys) {
		return nil, nil, false, false, fmt.Errorf("unexpected peek answer of %d values", len(res))
	}
	sec, _ := res[0].(int64)
	usec, _ := res[1].(int64)
	now := float64(sec*1000000 + usec)
	for i, t := range targets {
		raw, _ := res[2+i].(string)
		if raw != "" {
			found = true
		} else if t.tmpl != "" {
			continue // listed by the index, but gone (expired, or reset)
		}
		s := t.spec
		var used, remaining int64
		var reset float64 // µs
		if h.algo == algoGCRA {
			used, remaining, reset = peekGCRA(raw, now, s)
		} else {
			used, remaining, reset = peekSliding(raw, now, s)
		}
		resetD := int64(math.Ceil(reset)) // µs
		views = append(views, quotaView{
			Policy: t.policy, Requests: s.n, Window: s.window.String(),
			Used: used, Remaining: remaining,
			Reset: (resetD + 999999) / 1000000, ResetMs: (resetD + 999) / 1000,
			Template: t.tmpl,
		})
	}
	return h.templateViews(views), keys, complete, found, nil
}

// templateViews adds to views the rates rendered per request that have no
// state listed in them: their template only.
func (h *RedisRateLimit) templateViews(views []quotaView) []quotaView {
	for i, s := range h.static.rates {
		if s.nTmpl == "" && s.wTmpl == "" {
			continue
		}
		t, p := s.rateTemplate(), "r"+strconv.Itoa(i)
		if !slices.ContainsFunc(views, func(v quotaView) bool { return v.Policy == p || v.Policy == "" && strings.Contains(v.Template, t) }) {
			views = append(views, quotaView{Policy: p, Template: t})
		}
	}
	return views
}

// peekSliding reads a sliding_window log (see
// internal/ratelimit/scripts/ratelimit_sliding.lua: a 24-byte header {pos,
// lo, last}, then a ring of n 8-byte admission times in µs) as the script
// would count it at now: the admissions within the window, and µs until
// the oldest of them leaves it.
func peekSliding(raw string, now float64, s rateSpec) (used, remaining int64, reset float64) {
	const hdr = 24
	remaining = s.n
	if len(raw) < hdr {
		return 0, remaining, 0
	}
	f := func(off int) float64 { return math.Float64frombits(binary.BigEndian.Uint64([]byte(raw[off : off+8]))) }
	pos := int64(f(0))
	w := float64(s.window.Microseconds())
	thr := now - w
	first := -1.0
	for j := max(0, pos-s.n); j < pos; j++ {
		off := hdr + 8*int(j%s.n)
		if off+8 > len(raw) {
			break
		}
		if t := f(off); t >= thr {
			used++
			if first < 0 {
				first = t
			}
		}
	}
	remaining = max(0, s.n-used)
	if first >= 0 {
		reset = first + w + 1 - now
	}
	return used, remaining, reset
}

// peekGCRA reads a gcra theoretical arrival time (see
// internal/ratelimit/scripts/ratelimit_gcra.lua) as the script would report
// it at now without admitting: requests that may pass now, and µs until one
// more may.
func peekGCRA(raw string, now float64, s rateSpec) (used, remaining int64, reset float64) {
	burst := s.burst
	if raw == "" {
		return 0, burst, 0
	}
	if i := strings.IndexByte(raw, ' '); i >= 0 {
		raw = raw[:i] // "TAT S X ..." once a return happened: the TAT comes first
	}
	tat, err := strconv.ParseFloat(raw, 64)
	if err != nil {
		return 0, burst, 0
	}
	tat = max(tat, now)
	T := float64(s.window.Microseconds()) / float64(s.n)
	tau := float64(burst) * T
	debt := tat - now
	rem := int64(math.Floor((tau - debt + 0.5) / T))
	rem = min(max(rem, 0), burst)
	if rem < burst {
		reset = max(1, math.Ceil(debt-tau+float64(rem+1)*T))
	}
	return burst - rem, rem, reset
}

// quotaAnswer is GET and DELETE /redisdlm/limits/<handler>/<key>.
type quotaAnswer struct {
	Handler   string      `json:"handler"`
	Key       string      `json:"key"`
	Algorithm string      `json:"algorithm"`
	RedisKeys []string    `json:"redis_keys"`
	Rates     []quotaView `json:"rates,omitempty"`
	// While the key is under a ban (ban): when it ends (RFC 3339, Redis
	// time) and the milliseconds until then.
	BannedUntil string `json:"banned_until,omitempty"`
	BanLeftMs   int64  `json:"ban_left_ms,omitempty"`
	Reset       bool   `json:"reset,omitempty"` // DELETE: the quota was reset (and a ban lifted)
	// With rates rendered per request: false when the key's rate index
	// lists more than maxIndexed states, so some are missing.
	Complete *bool `json:"complete,omitempty"`
}

// completeField is the answer's complete field: only for a handler whose
// rates are rendered per request (the others know their keys).
func (h *RedisRateLimit) completeField(complete bool) *bool {
	if !h.dynamic {
		return nil
	}
	return &complete
}

// peekBan reads id's ban: when it ends (Redis time), or zero when the key
// is not under a ban.
func (h *RedisRateLimit) peekBan(ctx context.Context, id string) (until time.Time, left time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	pipe := h.client.Redis.Pipeline()
	now := pipe.Time(ctx)
	ttl := pipe.PTTL(ctx, h.banKey(id))
	if _, err := pipe.Exec(ctx); err != nil {
		return time.Time{}, 0, err
	}
	if left = ttl.Val(); left <= 0 {
		return time.Time{}, 0, nil
	}
	return now.Val().Add(left), left, nil
}

func (h *RedisRateLimit) inspectQuota(w http.ResponseWriter, r *http.Request, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty rate limit key")
	}
	id := adminLimitID(r, key)
	views, keys, complete, found, err := h.peekQuota(r.Context(), id)
	if err != nil {
		return shared.AdminError(http.StatusBadGateway, "reading the quota of %q: %v", key, err)
	}
	banUntil, banLeft, err := h.peekBan(r.Context(), id)
	if err != nil {
		return shared.AdminError(http.StatusBadGateway, "reading the ban of %q: %v", key, err)
	}
	if !found && banLeft == 0 {
		return shared.AdminError(http.StatusNotFound, "no quota state for key %q (nothing counted in its windows)", key)
	}
	a := quotaAnswer{Handler: shared.HandlerRef(h.Name), Key: key, Algorithm: h.algo, RedisKeys: keys, Rates: views, Complete: h.completeField(complete)}
	if banLeft > 0 {
		a.BannedUntil, a.BanLeftMs = banUntil.UTC().Format(time.RFC3339Nano), banLeft.Milliseconds()
	}
	return shared.WriteJSON(w, a)
}

// resetQuota deletes every rate state of a key (the literal rates', and
// every rendered rate's that Redis holds for it) and its ban, forgets the
// key in the deny caches (and fail_local limiters) of copies (h and the
// copies of the same named handler in other HTTP servers of the config),
// and tells every instance to forget it in the deny caches and local
// limiters of the handler's prefix (Pub/Sub, ratelimit_forget.go).
func (h *RedisRateLimit) resetQuota(w http.ResponseWriter, r *http.Request, copies []*RedisRateLimit, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty rate limit key")
	}
	id := adminLimitID(r, key)
	ctx, cancel := context.WithTimeout(r.Context(), h.timeout)
	defer cancel()
	targets, complete, err := h.quotaTargets(ctx, id)
	if err != nil {
		return shared.AdminError(http.StatusBadGateway, "finding the quota of %q: %v", key, err)
	}
	var keys []string
	for _, t := range targets {
		keys = append(keys, t.key)
	}
	if h.Ban > 0 {
		keys = append(keys, h.banKey(id))
	}
	// A ban set by another handler with the same prefix goes too, and the
	// key's rate index.
	del := keys
	if h.Ban <= 0 {
		del = append(slices.Clip(keys), h.banKey(id))
	}
	if h.dynamic {
		del = append(slices.Clip(del), h.indexKey(id))
	}
	n, err := h.client.Redis.Del(ctx, del...).Result()
	for _, o := range copies {
		if o.deny != nil {
			o.deny.Forget(id)
		}
		if o.announced != nil {
			o.announced.Forget(id)
		}
		if o.local != nil {
			o.local.lim.Forget(o.keyHead + id + "}")
		}
	}
	if err != nil {
		return shared.AdminError(http.StatusBadGateway, "resetting the quota of %q: %v", key, err)
	}
	if err := ratelimit.PublishForget(ctx, h.client.Redis, h.Prefix, id); err != nil {
		h.logger.Warn("telling the other instances of a quota reset failed; their deny caches forget the key when it expires there, their local limiters (fail_local) when its windows pass",
			zap.String("key", key), zap.String("handler", shared.HandlerRef(h.Name)), zap.Error(err))
	}
	if n == 0 {
		return shared.AdminError(http.StatusNotFound, "no quota state for key %q (nothing to reset)", key)
	}
	h.logger.Warn("rate limit quota reset through the admin API", zap.String("key", key))
	return shared.WriteJSON(w, quotaAnswer{Handler: shared.HandlerRef(h.Name), Key: key, Algorithm: h.algo, RedisKeys: keys, Reset: true, Complete: h.completeField(complete)})
}

// AdminKind, AdminName, AdminView and ServeAdmin are the handler's side of
// the admin API (internal/shared's registry, the redisadmin module).
func (h *RedisRateLimit) AdminKind() string { return "redis_ratelimit" }

func (h *RedisRateLimit) AdminName() string { return h.Name }

func (h *RedisRateLimit) AdminView(v *shared.HandlerView) {
	v.Prefix, v.Keys, v.Algorithm = h.Prefix, []string{h.keyTemplateText()}, h.algo
	for j, s := range h.static.rates {
		rv := shared.RateView{Policy: "r" + strconv.Itoa(j), Requests: s.n, Window: s.window.String()}
		if s.nTmpl != "" || s.wTmpl != "" {
			rv = shared.RateView{Policy: rv.Policy, Template: s.rateTemplate()}
		}
		v.Rates = append(v.Rates, rv)
	}
}

// ServeAdmin answers GET .../<key> (the quota's state) and DELETE
// .../<key> (reset the quota and lift the ban, in every copy of this named
// handler in the config).
func (h *RedisRateLimit) ServeAdmin(w http.ResponseWriter, r *http.Request, e *shared.AdminEntry, key, sub string) error {
	switch {
	case sub != "":
		return shared.AdminError(http.StatusNotFound, "no such redisdlm admin resource %q; see GET /redisdlm/", r.URL.Path)
	case r.Method == http.MethodGet:
		return h.inspectQuota(w, r, key)
	case r.Method == http.MethodDelete:
		var copies []*RedisRateLimit
		for _, c := range shared.Copies(e) {
			if o, ok := c.(*RedisRateLimit); ok {
				copies = append(copies, o)
			}
		}
		return h.resetQuota(w, r, copies, key)
	}
	return shared.AdminError(http.StatusMethodNotAllowed, "method %s not allowed; use GET or DELETE", r.Method)
}

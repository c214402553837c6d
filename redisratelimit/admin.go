package redisratelimit

// The rate limiter's side of the admin API: a key's quota per rate, read
// without counting a request, and a reset of that quota.

import (
	"context"
	_ "embed"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"go.uber.org/zap"
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

// literalRates are the rates of the handler whose n and window are
// literals, with their policy names: the engine reads their states by
// name; a rate rendered per request is found in the key's rate index.
func (h *RedisRateLimit) literalRates() (rates []ratelimit.Rate, policies []string) {
	for i, s := range h.specs {
		if s.nTmpl == "" && s.wTmpl == "" {
			rates, policies = append(rates, h.static.Rates[i]), append(policies, "r"+strconv.Itoa(i))
		}
	}
	return rates, policies
}

// templates is the rates rendered per request, as written, and the policy
// that explains a rendered rate when one rate template does (else "").
func (h *RedisRateLimit) templates() (tmpl, policy string) {
	n := 0
	for i, s := range h.specs {
		if s.nTmpl == "" && s.wTmpl == "" {
			continue
		}
		if n++; n > 1 {
			tmpl += ", "
		}
		tmpl += s.rateTemplate()
		policy = "r" + strconv.Itoa(i)
	}
	if n != 1 {
		policy = ""
	}
	return tmpl, policy
}

// peekQuota reads the quota of one limit id without recording anything.
// found is false when no rate has state for it.
func (h *RedisRateLimit) peekQuota(ctx context.Context, id string) (views []quotaView, keys []string, complete, found bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	literal, policies := h.literalRates()
	q, err := h.limit.Peek(ctx, h.client.Redis, id, literal)
	if err != nil {
		return nil, nil, false, false, err
	}
	tmpl, policy := h.templates()
	for i, s := range q.States {
		keys = append(keys, s.Key)
		found = found || s.Held
		v := quotaView{Requests: s.Rate.N, Window: s.Rate.Window.String(), Used: s.Used, Remaining: s.Remaining}
		if s.Indexed {
			if !s.Held {
				continue // listed by the index, but gone (expired, or reset)
			}
			v.Policy, v.Template = policy, tmpl
		} else {
			v.Policy = policies[i]
		}
		us := s.Reset.Microseconds()
		v.Reset, v.ResetMs = (us+999999)/1000000, (us+999)/1000
		views = append(views, v)
	}
	return h.templateViews(views), keys, q.Complete, found, nil
}

// templateViews adds to views the rates rendered per request that have no
// state listed in them: their template only.
func (h *RedisRateLimit) templateViews(views []quotaView) []quotaView {
	for i, s := range h.specs {
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
	// lists more states than are read (a thousand), so some are missing.
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
	return h.limit.PeekBan(ctx, h.client.Redis, id)
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
	a := quotaAnswer{Handler: shared.HandlerRef(h.Name), Key: key, Algorithm: h.algo.Name(), RedisKeys: keys, Rates: views, Complete: h.completeField(complete)}
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
// limiters of the handler's prefix (Pub/Sub, forget.go).
func (h *RedisRateLimit) resetQuota(w http.ResponseWriter, r *http.Request, copies []*RedisRateLimit, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty rate limit key")
	}
	id := adminLimitID(r, key)
	ctx, cancel := context.WithTimeout(r.Context(), h.timeout)
	defer cancel()
	literal, _ := h.literalRates()
	res, err := h.limit.Reset(ctx, h.client.Redis, id, literal)
	for _, o := range copies {
		if o.deny != nil {
			o.deny.Forget(id)
		}
		if o.announced != nil {
			o.announced.Forget(id)
		}
		if o.local != nil {
			o.local.lim.Forget(o.limit.KeysOf(id))
		}
	}
	if err != nil {
		return shared.AdminError(http.StatusBadGateway, "resetting the quota of %q: %v", key, err)
	}
	if res.PublishErr != nil {
		h.logger.Warn("telling the other instances of a quota reset failed; their deny caches forget the key when it expires there, their local limiters (fail_local) when its windows pass",
			zap.String("key", key), zap.String("handler", shared.HandlerRef(h.Name)), zap.Error(res.PublishErr))
	}
	if res.Deleted == 0 {
		return shared.AdminError(http.StatusNotFound, "no quota state for key %q (nothing to reset)", key)
	}
	h.logger.Warn("rate limit quota reset through the admin API", zap.String("key", key))
	return shared.WriteJSON(w, quotaAnswer{Handler: shared.HandlerRef(h.Name), Key: key, Algorithm: h.algo.Name(), RedisKeys: res.Keys, Reset: true, Complete: h.completeField(res.Complete)})
}

// AdminKind, AdminName, AdminView and ServeAdmin are the handler's side of
// the admin API (internal/shared's registry, the redisadmin module).
func (h *RedisRateLimit) AdminKind() string { return "redis_ratelimit" }

func (h *RedisRateLimit) AdminName() string { return h.Name }

func (h *RedisRateLimit) AdminView(v *shared.HandlerView) {
	v.Prefix, v.Keys, v.Algorithm = h.Prefix, []string{h.keyTemplateText()}, h.algo.Name()
	for j, s := range h.specs {
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

package redisratelimit

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// One decision: the deny cache, else one script call; returning an
// admission (count, wait); the fail policy.

// decision is the outcome for one request (internal/ratelimit).
type decision = ratelimit.Decision

// decide answers from the deny cache, else asks Redis (one script call).
func (h *RedisRateLimit) decide(ctx context.Context, id string, p *plan) (out decision, err error) {
	if p.Over >= 0 {
		// More than a rate can ever admit: rejected at once, with no
		// Retry-After (no moment would do).
		return decision{Tight: p.Over}, nil
	}
	cacheID := id
	if p.deny != "" {
		cacheID = id + "\x00" + p.deny
	}
	if d, ok := h.cached(cacheID, id, p); ok {
		return d, nil
	}
	if _, ok := h.keptBan(id); ok {
		defer func() { out, err = h.checkedBan(ctx, id, out, err) }()
	}
	var reserved ratelimit.Reservation
	if h.local != nil {
		if err := h.awaitCounted(ctx); err != nil {
			return decision{}, err
		}
		if err := h.chargeFirst(ctx, id, p); err != nil {
			return decision{}, err
		}
		var err error
		if reserved, err = h.capReturn(id, p); err != nil {
			return decision{}, err
		}
	}
	c := h.limit.DecisionCall(id, p.Plan)
	sent, restarts := h.now(), h.restarts()
	err = h.client.RateLimit(ctx, c, (*breakerLog)(h))
	got := h.now()
	if err == nil && h.local != nil && h.fromRestarted(restarts) {
		err = errRestartHold // an answer of the restarted Redis: decided locally
	}
	if err == nil {
		var d decision
		if d, err = c.Decision(); err == nil {
			if h.local != nil {
				h.noteRedis(id, p, d, sent, got, reserved)
			}
			if !d.Allowed {
				h.remember(cacheID, id, p, d, sent, got)
			}
			if d.Ban == ratelimit.BanStarted {
				h.announceBan(ctx, id, d, sent)
			}
			return d, nil
		}
	} else if h.Wait > 0 && ctx.Err() != nil && c.Taken() {
		h.returnUnheard(id, p, c)
	}
	if !reserved.IsZero() {
		h.local.lim.Unreserve(h.localRates(id, p), p.Cost, reserved)
	}
	return decision{}, err
}

// returnUnheard gives back, once its answer comes, an admission held for
// a client that went away while its decision was on its way to Redis: as
// holdFor gives back the admission of a client that goes away while held
// (a client that goes away uses no quota).
func (h *RedisRateLimit) returnUnheard(id string, p *plan, c *ratelimit.Call) {
	h.client.Conn.Use() // the client stays open until the return is sent
	go func() {
		defer h.client.Conn.Unuse()
		<-c.Done()
		if d, err := c.Decision(); err == nil && d.Allowed && d.Hold > 0 {
			h.settle(id, p, d)
		}
	}()
}

// anyCost asks the deny cache for a ban only: no rejection of a request
// has cost 0.
const anyCost = 0

// cached answers from the deny cache: a rejection of this plan and cost
// (cacheID), or a ban of the key (id), under any plan.
func (h *RedisRateLimit) cached(cacheID, id string, p *plan) (decision, bool) {
	if h.deny == nil {
		return decision{}, false
	}
	e, ok := h.deny.Get(cacheID, p.Cost)
	if !ok && cacheID != id {
		e, ok = h.deny.Get(id, anyCost)
	}
	if !ok {
		return decision{}, false
	}
	return h.fromCache(e), true
}

// fromCache is the decision a deny-cache entry makes now.
func (h *RedisRateLimit) fromCache(e ratelimit.DenyEntry) decision {
	now := h.now()
	d := decision{Tight: e.Tight, Remaining: e.Left, Wait: e.RetryAt.Sub(now), Reset: e.RetryAt.Sub(now), Cached: true}
	if e.Banned {
		d.Ban = ratelimit.Banned
	}
	return d
}

// keptBan is id's ban kept across a Pub/Sub reconnect to the same Redis
// process (forget.go), as the decision it makes: a lift may have
// been missed, so the key's next request asks Redis (checkedBan).
func (h *RedisRateLimit) keptBan(id string) (decision, bool) {
	if h.deny == nil {
		return decision{}, false
	}
	e, ok := h.deny.Kept(id)
	if !ok {
		return decision{}, false
	}
	return h.fromCache(e), true
}

// checkedBan settles a kept ban once Redis was asked about its key:
// Redis's decision stands, and one without the ban means the ban was lifted
// meanwhile; without a decision (Redis unreachable, local mode) the kept
// ban holds until it ends.
func (h *RedisRateLimit) checkedBan(ctx context.Context, id string, d decision, err error) (decision, error) {
	if err == nil {
		if d.Ban == ratelimit.NotBanned {
			h.deny.DropKept(id)
		}
		return d, nil
	}
	if kept, ok := h.keptBan(id); ok && ctx.Err() == nil {
		return kept, nil
	}
	return d, err
}

// announceBan tells every instance of the ban decision d started
// (Limit.AnnounceBan, forget.go), so that each holds it until
// it ends, also through an outage that follows. It is sent before the
// request is answered, even when its client went away.
func (h *RedisRateLimit) announceBan(ctx context.Context, id string, d decision, sent time.Time) {
	// The ban started after sent: what is left of it is at least this.
	gone := h.now().Sub(sent)
	left, retry := h.ban()-gone, d.Wait-gone
	if left <= 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.timeout)
	defer cancel()
	if err := h.limit.AnnounceBan(ctx, h.client.Redis, id, left, retry); err != nil {
		h.logger.Warn("announcing a ban to the other instances failed; they learn it from redis on the key's next request there",
			zap.String("redis", h.client.Settings.Display()), zap.Error(err))
	}
}

// remember puts a rejection in the deny cache: a ban under the key (it
// rejects every plan and cost), any other rejection under its plan and cost.
// No rejection but a ban with count or wait: an answer that does not count,
// or a held client that goes away, returns its admission, on any instance,
// so no rejection is known to last.
//
// A rejection a log's order made, or made longer, is not kept: the held
// admission before it may be given back at any moment. A ban is kept until the ban
// ends, even when its Retry-After is later (the quota that started it
// admits the request only after that): then requests of other costs and
// plans may pass.
func (h *RedisRateLimit) remember(cacheID, id string, p *plan, d decision, sent, got time.Time) {
	if !h.remembers(d) {
		return
	}
	// The script ran after sent and before got, so the request passes
	// no earlier than sent+wait (the cache holds until shortly before
	// that, minus a margin for clock-rate differences) and surely by
	// got+wait (what Retry-After reports from the cache).
	margin := time.Millisecond + d.Wait/1000
	e := ratelimit.DenyEntry{Until: sent.Add(d.Wait - margin), RetryAt: got.Add(d.Wait), Tight: d.Tight, Left: d.Remaining, Cost: p.Cost}
	if d.Ban != ratelimit.NotBanned {
		e.Banned, e.Left = true, 0
		cacheID = id
		banLeft := d.BanLeft
		if d.Ban == ratelimit.BanStarted {
			banLeft = h.ban()
		}
		if banLeft < d.Wait {
			e.Until = sent.Add(banLeft - time.Millisecond - banLeft/1000)
		}
	}
	h.deny.Put(cacheID, e)
}

// remembers reports whether remember keeps the rejection d.
func (h *RedisRateLimit) remembers(d decision) bool {
	return h.deny != nil && !d.Ordered && (d.Ban != ratelimit.NotBanned || h.counts == nil && h.Wait == 0)
}

// settle returns an admission: its answer does not count, or its client
// went away while it was held. It runs on a bounded context of its own
// (the request's may be over); a failure is logged, and the reservation
// then ages out with its window like any admission.
func (h *RedisRateLimit) settle(id string, p *plan, d decision) {
	c := h.limit.ReturnCall(id, p.Plan, d)
	if h.deny != nil && p.deny == "" {
		h.deny.Drop(id) // this instance's deny may be stale now
	} else if h.deny != nil {
		h.deny.Drop(id + "\x00" + p.deny)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*h.timeout)
	defer cancel()
	if err := h.client.RateLimit(ctx, c, (*breakerLog)(h)); err != nil {
		if due, n := h.settleWarn.Due(); due {
			h.logger.Warn("returning a rate-limit admission failed; it ages out with its window",
				zap.String("redis", h.client.Settings.Display()), zap.Error(err), zap.Int64("failures_since_last_warning", n))
		}
	}
}

// breakerLog logs the changes of the breaker of a handler's client, through
// the handler's logger of the moment.
type breakerLog RedisRateLimit

func (b *breakerLog) BreakerOpened(consecutiveFailures int) {
	b.logger.Warn("redis unreachable: rate-limit decisions follow the fail policy without calling redis; probing it every second",
		zap.Int("consecutive_failures", consecutiveFailures))
}

func (b *breakerLog) BreakerClosed() {
	b.logger.Info("redis reachable again; rate limiting resumes")
}

// failPolicy answers when Redis could not decide. (Bad input never comes
// here: see badInput.)
func (h *RedisRateLimit) failPolicy(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, p *plan, id string, err error) error {
	if h.local != nil {
		return h.serveLocal(w, r, next, p, id, err)
	}
	h.counters[shared.ResultError].Inc()
	h.warnFail(err)
	h.policyHeader(w, r, p)
	if h.FailClosed {
		// The breaker probes Redis about once a second.
		w.Header().Set(HeaderRetryAfter, "1")
		return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("redis_ratelimit: no decision: %w", err))
	}
	return next.ServeHTTP(w, r)
}

// policyHeader sets the RateLimit-Policy field of an answer made without
// a decision.
func (h *RedisRateLimit) policyHeader(w http.ResponseWriter, r *http.Request, p *plan) {
	if !h.sendHdrs {
		return
	}
	defer caddyhttp.SetVar(r.Context(), stackVar, h) // a later handler adds to it
	if prev, ok := caddyhttp.GetVar(r.Context(), stackVar).(*RedisRateLimit); ok && prev != h {
		stackHeaders(w.Header(), prev.label, h.label, p.policy, "")
	} else {
		w.Header().Set(HeaderRateLimitPolicy, p.policy)
	}
}

// warnFail logs decisions made without Redis at most every failWarnEvery.
func (h *RedisRateLimit) warnFail(err error) {
	due, n := h.warn.Due()
	if !due {
		return
	}
	policy := "admitting requests (fail open)"
	if h.FailClosed {
		policy = "rejecting requests with 503 (fail_closed)"
	}
	h.logger.Warn("redis unavailable for rate limiting; "+policy,
		zap.String("redis", h.client.Settings.Display()),
		zap.Error(err),
		zap.Int64("decisions_since_last_warning", n))
}

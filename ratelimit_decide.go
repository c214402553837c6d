package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// One decision: the deny cache, else one script call; returning an
// admission (count, wait); the fail policy.

// decision is the outcome for one request.
type decision struct {
	allowed   bool
	hold      time.Duration // admitted: how long to hold the request until its slot
	wait      time.Duration // rejected: until the request would be admitted (0 = never)
	at        int64         // admitted: the time (µs, Redis TIME) it was recorded at
	tight     int           // the rate reported in the RateLimit field
	remaining int64         // of rate tight
	reset     time.Duration // until rate tight's quota grows (0 = full)
	cached    bool          // answered from the deny cache
	ans       []int64       // the script's answer (settle reads what gcra wrote)
}

// decide answers from the deny cache, else asks Redis (one script call).
func (h *RedisRateLimit) decide(ctx context.Context, id string, p *plan) (decision, error) {
	if p.over >= 0 {
		// More than a rate can ever admit: rejected at once, with no
		// Retry-After (no moment would do).
		return decision{tight: p.over}, nil
	}
	cacheID := id
	if p.deny != "" {
		cacheID = id + "\x00" + p.deny
	}
	// No deny cache with count: an answer that does not count returns its
	// admission, on any instance, so no rejection is known to last.
	if h.deny != nil {
		if e, ok := h.deny.get(cacheID, h.now(), p.cost); ok {
			return decision{tight: e.tight, remaining: e.left, wait: e.retryAt.Sub(h.now()), reset: e.retryAt.Sub(h.now()), cached: true}, nil
		}
	}
	var keys [4]string
	c := &rlCall{script: h.script, argv: p.argv, keys: h.redisKeys(keys[:0], id, p)}
	sent := h.now()
	res, err := h.client.rateLimit(ctx, c, h.logger)
	got := h.now()
	if err != nil {
		return decision{}, err
	}
	d, err := parseDecision(res, len(p.rates), decisionScripts[h.script])
	if err != nil {
		return decision{}, err
	}
	if !d.allowed && h.deny != nil {
		// The script ran after sent and before got, so the request passes
		// no earlier than sent+wait (the cache holds until shortly before
		// that, minus a margin for clock-rate differences) and surely by
		// got+wait (what Retry-After reports from the cache).
		margin := time.Millisecond + d.wait/1000
		h.deny.put(cacheID, denyEntry{until: sent.Add(d.wait - margin), retryAt: got.Add(d.wait), tight: d.tight, left: d.remaining, cost: p.cost}, got)
	}
	return d, nil
}

// redisKeys appends the Redis keys of id's rates in plan p to buf.
func (h *RedisRateLimit) redisKeys(buf []string, id string, p *plan) []string {
	for _, s := range p.rates {
		buf = append(buf, h.keyHead+id+s.tail)
	}
	return buf
}

// parseDecision reads one decision's answer: {hold when admitted (>= 0), else
// minus the wait; time recorded; then per rate remaining, reset and, with
// per = 4 (gcra), the TAT written and the key's sum of returns}.
func parseDecision(vals []int64, nrates, per int) (decision, error) {
	if per < 2 || len(vals) != 2+per*nrates || vals[0] == failedRead || vals[0] == failedRun {
		return decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v", vals)
	}
	d := decision{allowed: vals[0] >= 0, tight: -1, ans: vals}
	if d.allowed {
		d.hold, d.at = time.Duration(vals[0])*time.Microsecond, vals[1]
	} else {
		d.wait = time.Duration(-vals[0]) * time.Microsecond
	}
	// The tightest rate: the least remaining, then the longest until it
	// grows; of a rejected request, among the rates that reject it (their
	// remaining comes as -(remaining+1)).
	for i := 0; i < nrates; i++ {
		rem, reset := vals[2+per*i], time.Duration(vals[3+per*i])*time.Microsecond
		rejects := rem < 0
		if rejects {
			rem = -rem - 1
		}
		if !d.allowed && !rejects {
			continue
		}
		if d.tight < 0 || rem < d.remaining || rem == d.remaining && reset > d.reset {
			d.tight, d.remaining, d.reset = i, rem, reset
		}
	}
	if d.tight < 0 {
		return decision{}, fmt.Errorf("redis_ratelimit: unexpected script answer %v (rejected by no rate)", vals)
	}
	return d, nil
}

// settle returns an admission: its answer does not count, or its client
// went away while it was held. It runs on a bounded context of its own
// (the request's may be over); a failure is logged, and the reservation
// then ages out with its window like any admission.
func (h *RedisRateLimit) settle(id string, p *plan, d decision) {
	var keys [4]string
	c := &rlCall{script: h.giveBack, keys: h.redisKeys(keys[:0], id, p)}
	if h.algo == algoGCRA {
		// Per rate also its burst, the TAT this admission wrote and the
		// key's sum of returns then: by them a rate gives back only what is
		// left of this admission in its schedule (while a held request
		// waits on the key: only while no later admission came after it).
		c.argv = make([]any, 0, 1+5*len(p.rates))
		c.argv = append(c.argv, p.cost)
		for i, s := range p.rates {
			c.argv = append(c.argv, s.n, s.window.Microseconds(), s.burst, d.ans[4+4*i], d.ans[5+4*i])
		}
	} else {
		c.argv = make([]any, 0, 2+2*len(p.rates))
		c.argv = append(c.argv, d.at, p.cost)
		for _, s := range p.rates {
			c.argv = append(c.argv, s.n, s.window.Microseconds())
		}
	}
	if h.deny != nil && p.deny == "" {
		h.deny.drop(id) // this instance's deny may be stale now
	} else if h.deny != nil {
		h.deny.drop(id + "\x00" + p.deny)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*h.timeout)
	defer cancel()
	if _, err := h.client.rateLimit(ctx, c, h.logger); err != nil {
		if due, n := h.settleWarn.due(); due {
			h.logger.Warn("returning a rate-limit admission failed; it ages out with its window",
				zap.String("redis", h.client.settings.display()), zap.Error(err), zap.Int64("failures_since_last_warning", n))
		}
	}
}

// failPolicy answers when Redis could not decide. (Bad input never comes
// here: see badInput.)
func (h *RedisRateLimit) failPolicy(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, p *plan, err error) error {
	h.counters[resultError].Inc()
	h.warnFail(err)
	if h.sendHdrs {
		if prev, ok := caddyhttp.GetVar(r.Context(), stackVar).(*RedisRateLimit); ok && prev != h {
			stackHeaders(w.Header(), prev.label, h.label, p.policy, "")
		} else {
			w.Header().Set(HeaderRateLimitPolicy, p.policy)
		}
	}
	if h.FailClosed {
		// The breaker probes Redis about once a second.
		w.Header().Set(HeaderRetryAfter, "1")
		return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("redis_ratelimit: no decision: %w", err))
	}
	return next.ServeHTTP(w, r)
}

// warnFail logs decisions made without Redis at most every failWarnEvery.
func (h *RedisRateLimit) warnFail(err error) {
	due, n := h.warn.due()
	if !due {
		return
	}
	policy := "admitting requests (fail open)"
	if h.FailClosed {
		policy = "rejecting requests with 503 (fail_closed)"
	}
	h.logger.Warn("redis unavailable for rate limiting; "+policy,
		zap.String("redis", h.client.settings.display()),
		zap.Error(err),
		zap.Int64("decisions_since_last_warning", n))
}

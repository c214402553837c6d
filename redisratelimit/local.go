package redisratelimit

// fail_local: while Redis is unreachable, this instance decides on its own
// at its share of every rate (internal/ratelimit's Local); what it admits
// is charged to Redis once Redis answers again. N, the instances sharing
// the prefix, comes from `instances` or the heartbeats (fleet.go).
// The state lives in a pool across config reloads (localPool).

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// localRatesMax bounds the rates of keys one local limiter keeps.
const localRatesMax = 20000

// localPool keeps the fail_local state of each instance, Redis and prefix
// across config reloads: a reload during an outage keeps deciding from the
// same counts, and the admissions it made before are still charged when
// Redis answers (the handlers of the new config take the state before
// those of the old one let it go).
var localPool = caddy.NewUsagePool()

// localState is the runtime state of the fail_local handlers of one
// instance on one Redis and prefix (they share their keys in Redis, so
// they share what they admitted on their own as well).
type localState struct {
	lim *ratelimit.Local
	// Deciding locally since the last Redis answer.
	mode atomic.Bool
	// Decisions made locally in this local mode.
	n atomic.Int64
	// When this instance last came back from deciding locally, or may have
	// (UnixNano; 0: never; in the hold after a restart of Redis, the hold's
	// end): for ReturnCap after it this instance also holds every key to
	// its share (capReturn). It only moves forward (returnAt).
	back atomic.Int64
	// The last heartbeat got no answer (Redis unreachable): while local
	// mode lasts, every request is held to the share (capReturn).
	unanswered atomic.Bool
	// Redis TIME minus the local clock: local admission times become Redis
	// times when charged.
	clock clockOffset
	// The number of instances seen in the last heartbeat read (0: none yet).
	instances atomic.Int64
	// Redis restarted empty (restart.go).
	restart restartWatch
	// The Redis TIME (µs) of this instance's first heartbeat in the set
	// while some other instance has not beaten since (0: every other has
	// counted it): see noteFleet.
	joining atomic.Int64
}

// Destruct implements caddy.Destructor: nothing to release (charges still
// pending when the last fail_local handler on the prefix goes are dropped).
func (*localState) Destruct() error { return nil }

// acquireLocal takes the handler's fail_local state from localPool, made
// when missing. The state is named by the instance (per process), the
// Redis it limits in (its address, db and mode: a reload that changes the
// timeout or the credentials keeps it) and the prefix.
func (h *RedisRateLimit) acquireLocal() error {
	s := h.client.Settings
	s.Username, s.Password, s.CAFile, s.CertFile, s.KeyFile, s.TLSFiles, s.ClientName, s.Timeout = "", "", "", "", "", "", "", 0
	s.Addrs = make([]string, len(h.client.Settings.Addrs))
	for i, a := range h.client.Settings.Addrs {
		s.Addrs[i] = redisconn.RedactURL(a)
	}
	key := h.instance() + "\x00" + s.PoolKey() + "\x00" + h.Prefix
	v, _, err := localPool.LoadOrNew(key, func() (caddy.Destructor, error) {
		return &localState{lim: ratelimit.NewLocal(localRatesMax, time.Now())}, nil
	})
	if err != nil {
		return fmt.Errorf("redis_ratelimit: fail_local: %w", err)
	}
	h.local, h.localKey = v.(*localState), key
	h.seen = h.local.restart.watch(h.client.Check)
	return nil
}

// releaseLocal gives back what acquireLocal took.
func (h *RedisRateLimit) releaseLocal() {
	if h.localKey != "" {
		h.local.restart.unwatch(h.client.Check)
		_, _ = localPool.Delete(h.localKey)
		h.localKey = ""
	}
}

// returnAt moves back to t, unless it is later already.
func (s *localState) returnAt(t time.Time) {
	for {
		old := s.back.Load()
		if old >= t.UnixNano() || s.back.CompareAndSwap(old, t.UnixNano()) {
			return
		}
	}
}

// returnCapError is the answer of a decision that this instance's share
// rejects within ReturnCap of its return from local mode, with the local
// limiter's rejection: the request gets that rejection (a 429 of the local
// limiter, never a new local admission: Redis knows more than this instance
// then), and local mode does not start for it.
type returnCapError struct{ ld ratelimit.LocalDecision }

func (returnCapError) Error() string {
	return "redis_ratelimit: back from local mode (or joining), this instance's share of the key is spent"
}

// clockOffset estimates Redis TIME minus the local clock, µs, from the
// admissions Redis decides. Redis read its clock after the call was sent,
// so its time minus the local send time bounds the offset from above; the
// least bound of the last two seconds in which Redis admitted something is
// kept (that of the fastest round trip: a slow answer says little about
// when Redis read its clock). A local admission converted with it is never
// stamped earlier than it happened in Redis time (Redis would forget it
// early), at most a round trip later (stricter); a stepped clock is
// followed within two seconds of admissions.
type clockOffset struct {
	mu        sync.Mutex
	sec       int64 // the local second cur belongs to
	cur, prev int64 // the least bound of that second, and of the one before it
	n         int   // bounds kept: 0, 1 (cur), 2
}

// note takes the bound of one admission: Redis's time when it decided,
// minus the local time the call was sent, µs.
func (c *clockOffset) note(bound int64, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch s := now.Unix(); {
	case c.n == 0:
		c.sec, c.cur, c.n = s, bound, 1
	case s != c.sec:
		c.sec, c.prev, c.cur, c.n = s, c.cur, bound, 2
	default:
		c.cur = min(c.cur, bound)
	}
}

// get is the offset, µs (0 before any admission).
func (c *clockOffset) get() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.n {
	case 0:
		return 0
	case 1:
		return c.cur
	}
	return min(c.cur, c.prev)
}

// errLocalPending is the answer of a decision whose key holds local
// admissions not yet charged while Redis is not known to answer: it is
// decided locally (a Redis decision without them could double the limit).
var errLocalPending = errors.New("redis_ratelimit: local admissions wait to be charged to redis")

// errChargeOnItsWay is the answer of a decision whose key's charge another
// caller has on its way while Redis answers: it is decided locally until
// the charge lands (Redis would decide without it), and local mode does not
// start for it.
var errChargeOnItsWay = errors.New("redis_ratelimit: a charge of this key's local admissions is on its way to redis")

// chargeFirst charges the local admissions of this request's rates before
// Redis decides it, so that Redis decides with them. While Redis is not
// known to answer (local mode, or the breaker open), the request is decided
// locally at once: the fleet loop tries Redis (a heartbeat) twice a second
// and then charges every key; a request whose key has nothing left to
// charge is the breaker's probe, and its answer ends local mode.
func (h *RedisRateLimit) chargeFirst(ctx context.Context, id string, p *plan) error {
	if h.local.restart.holding(time.Now()) {
		return errRestartHold
	}
	if !h.local.lim.Pending() {
		return nil
	}
	rates := h.localRates(id, p)
	if !h.local.lim.PendingFor(rates) {
		return nil
	}
	if b := h.client.Batcher(); h.local.mode.Load() || b != nil && b.BreakerOpen() {
		return errLocalPending
	}
	now := time.Now()
	batches, onTheirWay := h.local.lim.TakeFor(rates, now)
	if err := h.charge(ctx, h.logger, batches, h.timeout); err != nil {
		return err
	}
	if onTheirWay {
		return errChargeOnItsWay
	}
	return nil
}

// localRates are the rates of id in plan p, as the local limiter takes them.
func (h *RedisRateLimit) localRates(id string, p *plan) []ratelimit.LocalRate {
	return h.limit.LocalRates(id, p.Plan)
}

// capReturn holds a request to this instance's share for ReturnCap after
// its return from local mode (see ReturnCap), and while local mode lasts
// with Redis not answering the heartbeat (the share decides then anyway):
// the request takes its place in the local limiter before Redis decides it
// (reserved, so concurrent requests do not pass the share together). It
// reports the reservation (zero: no cap now), or a returnCapError when the
// share rejects the request.
func (h *RedisRateLimit) capReturn(id string, p *plan) (ratelimit.Reservation, error) {
	now := h.now()
	back := h.local.back.Load()
	unheard := h.local.mode.Load() && h.local.unanswered.Load()
	if !unheard && (back == 0 || now.Sub(time.Unix(0, back)) >= ReturnCap) {
		return ratelimit.Reservation{}, nil
	}
	n := h.instances()
	if n == 0 {
		return ratelimit.Reservation{}, nil
	}
	ld, res := h.local.lim.Reserve(h.localRates(id, p), p.Cost, n, now)
	if !ld.Allowed {
		return ratelimit.Reservation{}, returnCapError{ld}
	}
	return res, nil
}

// noteRedis is called with each decision Redis made: an admission is noted
// (the local limiter starts from this instance's own admissions; what
// capReturn reserved is taken back), the clock offset kept, and
// local mode ends.
func (h *RedisRateLimit) noteRedis(id string, p *plan, d decision, sent, got time.Time, reserved ratelimit.Reservation) {
	switch {
	case d.Allowed && reserved.IsZero():
		h.local.lim.Note(h.localRates(id, p), p.Cost, got)
	case d.Allowed:
		// Noted when its answer came, as any admission (not when it was
		// reserved, a round trip earlier: it would leave this instance's
		// window that much early).
		h.local.lim.Confirm(h.localRates(id, p), p.Cost, reserved, got)
	case !reserved.IsZero():
		h.local.lim.Unreserve(h.localRates(id, p), p.Cost, reserved)
	}
	if d.Allowed {
		h.local.clock.note(d.At-d.Hold.Microseconds()-sent.UnixMicro(), got)
	}
	if h.local.mode.Load() && h.local.mode.CompareAndSwap(true, false) {
		h.local.returnAt(h.now())
		h.logger.Warn("redis reachable again: local rate limiting (fail_local) ends, decisions come from redis; charging the local admissions to redis",
			zap.Int64("local_decisions", h.local.n.Swap(0)))
	}
	if h.local.lim.Pending() {
		select {
		case h.fleet.wake <- struct{}{}:
		default:
		}
	}
}

// instances is N for the local share: `instances`, else the last count of
// heartbeats seen (0: none yet).
func (h *RedisRateLimit) instances() int64 {
	if h.Instances > 0 {
		return int64(h.Instances)
	}
	return h.local.instances.Load()
}

// serveLocal decides a request by the local limiter (Redis could not).
func (h *RedisRateLimit) serveLocal(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, p *plan, id string, cause error) error {
	n := h.instances()
	if n == 0 {
		return h.localClosed(w, r, p, h.warn, "redis unavailable for rate limiting and the number of instances sharing the limit was never seen (no heartbeat read, no instances set): rejecting requests with 503, as fail_closed",
			fmt.Errorf("redis_ratelimit: no decision (fail_local, but no instance count known): %w", cause))
	}
	if h.Instances == 0 && h.local.joining.Load() != 0 || errors.Is(cause, errNotCounted) {
		return h.localClosed(w, r, p, h.warn, "this instance is not yet counted by the others sharing the limit (it joined within the last heartbeat, and their share does not count it yet): rejecting requests with 503, as fail_closed",
			fmt.Errorf("redis_ratelimit: no decision (fail_local, this instance not yet counted by the others): %w", cause))
	}
	var capped returnCapError
	isCap := errors.As(cause, &capped)
	own := isCap || errors.Is(cause, errChargeOnItsWay) // Redis answers
	if !own && !h.local.mode.Load() && h.local.mode.CompareAndSwap(false, true) {
		h.local.returnAt(h.now()) // Redis may answer again at once
		h.logger.Warn("redis unavailable for rate limiting: enforcing every rate on this instance alone at its share (fail_local)",
			zap.String("redis", h.client.Settings.Display()), zap.Int64("instances", n), zap.Error(cause))
	}
	if !own {
		h.local.n.Add(1)
	}
	var ld ratelimit.LocalDecision
	if isCap {
		ld = capped.ld
	} else {
		ld = h.local.lim.Admit(h.localRates(id, p), p.Cost, n, h.now())
	}
	if ld.Full {
		return h.localClosed(w, r, p, h.fullWarn, "the local rate limiter (fail_local) is full of admissions still to charge to redis: rejecting the requests of new keys with 503, as fail_closed",
			fmt.Errorf("redis_ratelimit: no decision (fail_local, no room for a new key among %d with charges pending): %w", localRatesMax, cause))
	}
	h.counters[shared.ResultLocal].Inc()
	d := decision{Allowed: ld.Allowed, Wait: ld.Wait, Tight: ld.Tight, Remaining: ld.Remaining, Reset: ld.Reset}
	retry := int64(0)
	if !d.Allowed {
		retry = shared.RetryAfterSeconds(shared.Jittered(h.localRetry(d.Wait), h.Jitter))
	}
	if h.sendHdrs {
		h.setHeaders(r, w.Header(), p, d)
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.redis_ratelimit.remaining", d.Remaining)
		repl.Set("http.redis_ratelimit.retry_after", retry)
	}
	if !d.Allowed && !h.DryRun {
		if retry > 0 {
			w.Header().Set(HeaderRetryAfter, strconv.FormatInt(retry, 10))
		}
		return caddyhttp.Error(h.status, ErrRateLimited)
	}
	return next.ServeHTTP(w, r)
}

// localClosed answers a request that the local limiter cannot decide as
// fail_closed does: 503 with Retry-After 1 (the breaker probes Redis about
// once a second), counted as an error, and logged at most every
// failWarnEvery by warn.
func (h *RedisRateLimit) localClosed(w http.ResponseWriter, r *http.Request, p *plan, warn *shared.Warnings, msg string, err error) error {
	h.counters[shared.ResultError].Inc()
	if due, k := warn.Due(); due {
		h.logger.Warn(msg, zap.String("redis", h.client.Settings.Display()), zap.Error(err), zap.Int64("decisions_since_last_warning", k))
	}
	h.policyHeader(w, r, p)
	w.Header().Set(HeaderRetryAfter, "1")
	return caddyhttp.Error(http.StatusServiceUnavailable, err)
}

// ReturnCap is how long an instance back from fail_local's local mode holds
// every key to its local share as well as to Redis's decision: the other
// instances come back within it (in local mode they try Redis ten times a
// second) and charge what they admitted locally, which Redis does not know
// until then.
const ReturnCap = time.Second

// localProbe is how soon Redis decides again after a local decision: the
// breaker lets a call try Redis about once a second, and the fleet loop
// tries the heartbeat every localTick (the return's hold lasts ReturnCap;
// after a restart of Redis, decisions stay local until its hold ends).
const localProbe = time.Second

// localRetry is the Retry-After of a local rejection whose share admits
// it after wait (0: never at this share): the time until Redis decides
// again, when that comes first, since Redis knows the whole fleet's use
// and may admit it then.
func (h *RedisRateLimit) localRetry(wait time.Duration) time.Duration {
	until := max(localProbe, time.Until(time.Unix(0, h.local.restart.hold.Load())))
	if wait > 0 && wait < until {
		return wait
	}
	return until
}

// chargeLocal charges Redis with all local admissions, one script call per
// rate's key; what fails stays for the next try.
func (h *RedisRateLimit) chargeLocal(ctx context.Context) {
	// In the background: time enough for a Redis just back, so that few
	// charges wait for the next try.
	err := h.charge(ctx, h.fleet.logger, h.local.lim.TakeCharges(time.Now()), max(4*h.timeout, 2*time.Second))
	if err != nil && !errors.Is(err, errRestartHold) { // a restart is logged as it is seen
		h.fleet.logger.Warn("charging local admissions (fail_local) to redis failed; trying again", zap.Error(err))
	}
}

// charge charges Redis with batches (ratelimit.Local.Charge), each call
// bounded by timeout: a batch that may pass next time goes back to the
// local limiter and its error is returned; one that Redis refused for good
// is dropped (a warning to log names the first), since Redis answers and
// it is no reason to decide locally. A restart of Redis seen meanwhile
// ends it: the charge of the current windows again (Recharge) goes to the
// new process.
func (h *RedisRateLimit) charge(ctx context.Context, log *zap.Logger, batches []ratelimit.ChargeBatch, timeout time.Duration) error {
	rep, err := h.local.lim.Charge(ctx, h.client.Redis, batches, ratelimit.ChargeOptions{
		Offset:  h.local.clock.get(),
		Timeout: timeout,
		Superseded: func() func() bool {
			restarts := h.restarts()
			return func() bool { return h.redisRestarted(restarts, time.Now(), log) }
		},
	})
	if rep.Dropped > 0 {
		log.Warn("redis refused charges of local admissions (fail_local); dropped",
			zap.Int("rates", rep.Dropped), zap.String("key", rep.DroppedKey), zap.Error(rep.DroppedErr))
	}
	if errors.Is(err, ratelimit.ErrChargeSuperseded) {
		return errRestartHold
	}
	if err != nil {
		return err
	}
	if len(batches) > 0 {
		if c := log.Check(zap.InfoLevel, "local admissions (fail_local) charged to redis"); c != nil {
			c.Write(zap.Int("rates", len(batches)), zap.Int64("cost", rep.Cost))
		}
	}
	return nil
}

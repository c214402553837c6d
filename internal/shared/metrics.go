package shared

// Metrics. Every series carries a handler label: the handler's name, else
// a short hash of its JSON config (handlerLabel). A label's series live as
// long as some loaded handler has it: a reload provisions the new handlers
// before it cleans up the old ones, so a handler whose config did not
// change keeps its series (and their counts) across the reload.

import (
	"errors"
	"sync"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Collectors are created once per process and registered with each config
// load's registry. Labels never carry keys or client addresses.
var (
	metricsOnce sync.Once

	lockAcquireSeconds     *prometheus.HistogramVec // handler, result
	lockHeldSeconds        *prometheus.HistogramVec // handler
	lockWaiters            *prometheus.GaugeVec     // handler
	LockLostTotal          *prometheus.CounterVec   // handler
	LockDelays             *prometheus.CounterVec   // handler, result (lost|abandoned|forced)
	LockReleaseFailures    *prometheus.CounterVec   // handler
	lockReplays            *prometheus.CounterVec   // handler, result
	rateLimitTotal         *prometheus.CounterVec   // handler, result
	rateLimitWaitedSeconds *prometheus.HistogramVec // handler
	EvictingServers        *prometheus.GaugeVec     // handler
	FenceWritesVec         *prometheus.CounterVec   // handler, result
)

// RateLimitResults are the results of caddy_redis_ratelimit_requests_total:
// requests admitted, rejected, answered by the fail policy (Redis could not
// decide), answered 400 because a rate, window or cost rendered to
// something unusable, decided by the instance alone while Redis could not
// (fail_local), and refused by a ban. The result* constants index them.
var RateLimitResults = [...]string{"allowed", "denied", "error", "bad_request", "local", "banned"}

const (
	ResultAllowed = iota
	ResultDenied
	ResultError
	ResultBadRequest
	ResultLocal  // decided by this instance alone (fail_local)
	ResultBanned // refused by a ban (ban), without a rate's decision
)

// Outcomes of a redis_fence check (caddy_redis_fence_writes_total).
const (
	FenceAdmitted = iota
	FenceStale
	FenceMalformed
	FenceError
)

var FenceResults = [...]string{"admitted", "stale", "malformed", "error"}

func InitMetrics() {
	metricsOnce.Do(func() {
		h := []string{"handler"}
		hr := []string{"handler", "result"}
		FenceWritesVec = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_fence_writes_total",
			Help: "Writes checked by redis_fence: admitted, stale (a later holder wrote), malformed (missing, malformed or future token), error (Redis could not be asked: 503).",
		}, hr)
		lockAcquireSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "caddy_redis_lock_acquire_duration_seconds",
			Help:    "Time from the start of a redis_lock acquisition to its outcome.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, hr) // acquired|timeout|error|canceled
		lockHeldSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "caddy_redis_lock_held_duration_seconds",
			Help:    "Time a redis_lock lease was held.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, h)
		lockWaiters = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "caddy_redis_lock_waiters",
			Help: "Requests currently waiting for a redis_lock in this instance.",
		}, h)
		LockLostTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_lock_lost_total",
			Help: "Leases found lost by an extension while their request ran.",
		}, h)
		LockDelays = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_lock_delays_total",
			Help: "Leases of a redis_lock handler with lock_delay that ended without their holder's release, as this instance saw them (the key is then granted to nobody for lock_delay): lost (found lost by an extension, e.g. expired), abandoned (the client went away while the route ran), forced (force-released through the admin API).",
		}, hr) // lost|abandoned|forced
		LockReleaseFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_lock_release_failures_total",
			Help: "Failed releases of held leases (and undos of acquisitions whose outcome is unknown); each is retried in the background. Acquires that Redis refused hold nothing and are never counted.",
		}, h)
		lockReplays = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_lock_replays_total",
			Help: "redis_lock replay outcomes: answers replayed, responses stored or not stored, requests that did not match the stored one, requests refused because the key's run is in doubt.",
		}, hr) // replayed|stored|not_stored|mismatch|in_doubt
		rateLimitTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_ratelimit_requests_total",
			Help: "redis_ratelimit decisions.",
		}, hr) // rateLimitResults
		EvictingServers = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "caddy_redis_evicting_servers",
			Help: "Redis servers the handler uses whose maxmemory-policy evicts keys (locks need noeviction).",
		}, h)
		rateLimitWaitedSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "caddy_redis_ratelimit_waited_seconds",
			Help:    "Time redis_ratelimit held an admitted request until its slot (wait).",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, h)
	})
}

// allVecs are the collectors, for registration and for deleting a label's
// series.
func allVecs() []interface {
	prometheus.Collector
	DeletePartialMatch(prometheus.Labels) int
} {
	InitMetrics()
	return []interface {
		prometheus.Collector
		DeletePartialMatch(prometheus.Labels) int
	}{lockAcquireSeconds, lockHeldSeconds, lockWaiters, LockLostTotal, LockDelays, LockReleaseFailures, lockReplays, rateLimitTotal, rateLimitWaitedSeconds, EvictingServers, FenceWritesVec}
}

// RegisterMetrics registers the collectors with this config load's
// registry (which may be nil); a collector already there is fine.
func RegisterMetrics(ctx caddy.Context) error {
	reg := ctx.GetMetricsRegistry()
	vecs := allVecs()
	if reg == nil {
		return nil
	}
	for _, c := range vecs {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// LockSeries are one redis_lock handler's series.
type LockSeries struct {
	Acquired, Timeout, Canceled, Errored   prometheus.Observer
	Held                                   prometheus.Observer
	Waiters                                prometheus.Gauge
	Lost                                   prometheus.Counter
	DelayLost, DelayAbandoned, DelayForced prometheus.Counter // lock_delay began, by why
	Replayed, Stored, NotStored            prometheus.Counter
	Mismatch, InDoubt                      prometheus.Counter
}

func NewLockSeries(label string) LockSeries {
	InitMetrics()
	a := func(result string) prometheus.Observer { return lockAcquireSeconds.WithLabelValues(label, result) }
	r := func(result string) prometheus.Counter { return lockReplays.WithLabelValues(label, result) }
	LockReleaseFailures.WithLabelValues(label) // shown at 0 from the start
	return LockSeries{
		Acquired: a("acquired"), Timeout: a("timeout"), Canceled: a("canceled"), Errored: a("error"),
		Held:      lockHeldSeconds.WithLabelValues(label),
		Waiters:   lockWaiters.WithLabelValues(label),
		Lost:      LockLostTotal.WithLabelValues(label),
		DelayLost: LockDelays.WithLabelValues(label, "lost"), DelayAbandoned: LockDelays.WithLabelValues(label, "abandoned"),
		DelayForced: LockDelays.WithLabelValues(label, "forced"),
		Replayed:    r("replayed"), Stored: r("stored"), NotStored: r("not_stored"), Mismatch: r("mismatch"),
		InDoubt: r("in_doubt"),
	}
}

// RateLimitSeries are one redis_ratelimit handler's series.
type RateLimitSeries struct {
	Results [len(RateLimitResults)]prometheus.Counter // as RateLimitResults
	Waited  prometheus.Observer
}

func NewRateLimitSeries(label string) (s RateLimitSeries) {
	InitMetrics()
	for i, result := range RateLimitResults {
		s.Results[i] = rateLimitTotal.WithLabelValues(label, result)
	}
	s.Waited = rateLimitWaitedSeconds.WithLabelValues(label)
	return s
}

// NewFenceSeries returns one redis_fence handler's counters, as fenceResults.
func NewFenceSeries(label string) (s [len(FenceResults)]prometheus.Counter) {
	InitMetrics()
	for i, result := range FenceResults {
		s[i] = FenceWritesVec.WithLabelValues(label, result)
	}
	return s
}

// labels counts, per handler label, the loaded handlers that have it, and
// keeps the eviction gauge of each: the servers, among those of the
// clients its handlers use, whose policy evicts.
var labels = struct {
	sync.Mutex
	refs     map[string]int
	checks   map[string]map[*redisconn.Check]int  // label → the server checks of its handlers' clients
	evicting map[*redisconn.Check]map[string]bool // check → the addresses it found evicting
}{refs: map[string]int{}, checks: map[string]map[*redisconn.Check]int{}, evicting: map[*redisconn.Check]map[string]bool{}}

// LabelClaim is one handler's hold on its label (see observeHandler).
type LabelClaim struct {
	label   string
	clients []*Client
	kind    string
	logger  *zap.Logger
	once    sync.Once
}

// ObserveHandler claims label for a provisioned handler of kind ("lock",
// "rl", "fence") using clients: the label's series stay while it is held,
// the eviction gauge of the label counts the clients' evicting servers,
// and the log lines of the clients' shared parts (the releaser, the
// server checks, the batcher) go to logger. Cleanup calls release.
func ObserveHandler(kind, label string, logger *zap.Logger, clients ...*Client) *LabelClaim {
	InitMetrics()
	c := &LabelClaim{label: label, clients: clients, kind: kind, logger: logger}
	labels.Lock()
	labels.refs[label]++
	m := labels.checks[label]
	if m == nil {
		m = map[*redisconn.Check]int{}
		labels.checks[label] = m
	}
	for _, pc := range clients {
		m[pc.Check]++
	}
	setEvictingLocked(label)
	labels.Unlock()
	for _, pc := range clients {
		pc.Users.add(kind, label, logger)
	}
	return c
}

// Release gives the claim back (once; nil is fine): the label's series go
// when no loaded handler has it any more.
func (c *LabelClaim) Release() {
	if c == nil {
		return
	}
	c.once.Do(func() {
		for _, pc := range c.clients {
			pc.Users.remove(c.kind, c.label, c.logger)
		}
		labels.Lock()
		defer labels.Unlock()
		m := labels.checks[c.label]
		for _, pc := range c.clients {
			if m[pc.Check]--; m[pc.Check] <= 0 {
				delete(m, pc.Check)
			}
		}
		if labels.refs[c.label]--; labels.refs[c.label] > 0 {
			setEvictingLocked(c.label)
			return
		}
		delete(labels.refs, c.label)
		delete(labels.checks, c.label)
		for _, v := range allVecs() {
			v.DeletePartialMatch(prometheus.Labels{"handler": c.label})
		}
	})
}

// LabelLive reports whether a loaded handler has label.
func LabelLive(label string) bool {
	labels.Lock()
	defer labels.Unlock()
	return labels.refs[label] > 0
}

// setEvictingLocked sets the eviction gauge of label: the distinct
// evicting servers of its checks.
func setEvictingLocked(label string) {
	addrs := map[string]bool{}
	for sc := range labels.checks[label] {
		for a := range labels.evicting[sc] {
			addrs[a] = true
		}
	}
	EvictingServers.WithLabelValues(label).Set(float64(len(addrs)))
}

// newLockServer makes the lock engine's server of a pooled client: its
// log lines go to the handler they name (the releaser's), else to every
// lock handler using the client; its failed releases to
// caddy_redis_lock_release_failures_total of the lease's handler.
func newLockServer(id string, conn *redisconn.Conn, users *clientUsers) *lock.Server {
	s := lock.NewServer(id, conn, users.Slogger("lock"))
	s.OnReleaseFailure(countReleaseFailure)
	return s
}

// countReleaseFailure counts a failed release of a lease of handler that
// was held, or whose acquire outcome is unknown. A handler no longer loaded
// (its release still retried after a reload) is not counted: its series
// are gone, and counting would bring them back for good.
func countReleaseFailure(handler string) {
	InitMetrics()
	labels.Lock()
	defer labels.Unlock()
	if labels.refs[handler] > 0 {
		LockReleaseFailures.WithLabelValues(handler).Inc()
	}
}

// newServerCheck makes the server checks of one client (failover names a
// Sentinel group's master), logging to every handler using the client and
// reporting evicting servers to the handlers' gauges.
func newServerCheck(users *clientUsers, failover string) *redisconn.Check {
	return redisconn.NewCheck(redisconn.CheckOptions{Logger: users.Slogger(""), Failover: failover, OnEvicting: markEvicting})
}

// markEvicting records that sc found addr evicting (on) or no longer, and
// updates the gauges of the labels whose handlers use sc.
func markEvicting(sc *redisconn.Check, addr string, on bool) {
	InitMetrics()
	labels.Lock()
	defer labels.Unlock()
	if on {
		if labels.evicting[sc] == nil {
			labels.evicting[sc] = map[string]bool{}
		}
		labels.evicting[sc][addr] = true
	} else if m := labels.evicting[sc]; m != nil {
		delete(m, addr)
		if len(m) == 0 {
			delete(labels.evicting, sc)
		}
	}
	for label, m := range labels.checks {
		if m[sc] > 0 {
			setEvictingLocked(label)
		}
	}
}

// Evicting reports whether sc found addr with an evicting maxmemory-policy
// (what the eviction gauges count).
func Evicting(sc *redisconn.Check, addr string) bool {
	labels.Lock()
	defer labels.Unlock()
	return labels.evicting[sc][addr]
}

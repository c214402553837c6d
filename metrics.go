package redisdlm

import (
	"errors"
	"log/slog"
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

	lockAcquireSeconds *prometheus.HistogramVec
	lockHeldSeconds    prometheus.Histogram
	lockWaiters        prometheus.Gauge

	// The acquire histogram's four results, looked up once.
	acquiredSeconds, timeoutSeconds, canceledSeconds, errorSeconds prometheus.Observer
	lockLostTotal                                                  prometheus.Counter
	lockReleaseFailures                                            prometheus.Counter
	lockReplays                                                    *prometheus.CounterVec
	replayReplayed, replayStored, replayNotStored, replayMismatch  prometheus.Counter
	rateLimitTotal                                                 *prometheus.CounterVec
	evictingServers                                                prometheus.Gauge
	rateLimitWaitedSeconds                                         prometheus.Histogram
)

// rateLimitResults are the results of caddy_redis_ratelimit_requests_total:
// requests admitted, rejected, answered by the fail policy (Redis could not
// decide), answered 400 because a rate, window or cost rendered to
// something unusable, and refused by a ban. The result* constants index them.
var rateLimitResults = [...]string{"allowed", "denied", "error", "bad_request", "banned"}

const (
	resultAllowed = iota
	resultDenied
	resultError
	resultBadRequest
	resultBanned // refused by a ban (ban), without a rate's decision
)

// Outcomes of a redis_fence check (caddy_redis_fence_writes_total).
const (
	fenceAdmitted = iota
	fenceStale
	fenceMalformed
	fenceError
)

var (
	fenceWritesVec *prometheus.CounterVec
	fenceWrites    [4]prometheus.Counter
)

func initMetrics() {
	metricsOnce.Do(func() {
		fenceWritesVec = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_fence_writes_total",
			Help: "Writes checked by redis_fence: admitted, stale (a later holder wrote), malformed (missing, malformed or future token), error (Redis could not be asked: 503).",
		}, []string{"result"})
		for i, r := range []string{"admitted", "stale", "malformed", "error"} {
			fenceWrites[i] = fenceWritesVec.WithLabelValues(r)
		}
		lockAcquireSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "caddy_redis_lock_acquire_duration_seconds",
			Help:    "Time from the start of a redis_lock acquisition to its outcome.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"result"}) // acquired|timeout|error|canceled
		acquiredSeconds = lockAcquireSeconds.WithLabelValues("acquired")
		timeoutSeconds = lockAcquireSeconds.WithLabelValues("timeout")
		canceledSeconds = lockAcquireSeconds.WithLabelValues("canceled")
		errorSeconds = lockAcquireSeconds.WithLabelValues("error")
		lockHeldSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "caddy_redis_lock_held_duration_seconds",
			Help:    "Time a redis_lock lease was held.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		})
		lockWaiters = prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "caddy_redis_lock_waiters",
			Help: "Requests currently waiting for a redis_lock in this instance.",
		})
		lockLostTotal = prometheus.NewCounter(prometheus.CounterOpts{
			Name: "caddy_redis_lock_lost_total",
			Help: "Leases found lost by an extension while their request ran.",
		})
		lockReleaseFailures = prometheus.NewCounter(prometheus.CounterOpts{
			Name: "caddy_redis_lock_release_failures_total",
			Help: "Failed releases of held leases (and undos of acquisitions whose outcome is unknown); each is retried in the background. Acquires that Redis refused hold nothing and are never counted.",
		})
		lockReplays = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_lock_replays_total",
			Help: "redis_lock replay outcomes: answers replayed, responses stored or not stored, requests that did not match the stored one.",
		}, []string{"result"}) // replayed|stored|not_stored|mismatch
		replayReplayed = lockReplays.WithLabelValues("replayed")
		replayStored = lockReplays.WithLabelValues("stored")
		replayNotStored = lockReplays.WithLabelValues("not_stored")
		replayMismatch = lockReplays.WithLabelValues("mismatch")
		rateLimitTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "caddy_redis_ratelimit_requests_total",
			Help: "redis_ratelimit decisions.",
		}, []string{"result"}) // rateLimitResults
		evictingServers = prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "caddy_redis_evicting_servers",
			Help: "Redis servers in use whose maxmemory-policy evicts keys (locks need noeviction).",
		})
		rateLimitWaitedSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "caddy_redis_ratelimit_waited_seconds",
			Help:    "Time redis_ratelimit held an admitted request until its slot (wait).",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		})
	})
}

// registerMetrics registers the collectors with this config load's
// registry (which may be nil); a collector already there is fine.
func registerMetrics(ctx caddy.Context) error {
	initMetrics()
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{lockAcquireSeconds, lockHeldSeconds, lockWaiters, lockLostTotal, lockReleaseFailures, lockReplays, rateLimitTotal, rateLimitWaitedSeconds, evictingServers, fenceWritesVec} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// newLockServer makes the lock engine's server of a pooled client: its
// log lines go to Caddy's logger of the moment, its failed releases to
// caddy_redis_lock_release_failures_total.
func newLockServer(id string, conn *redisconn.Conn) *server {
	s := lock.NewServer(id, conn, engineLogger)
	s.OnReleaseFailure(countReleaseFailure)
	return s
}

// countReleaseFailure counts a failed release of a lease that was held, or
// whose acquire outcome is unknown.
func countReleaseFailure() {
	initMetrics()
	lockReleaseFailures.Inc()
}

// newServerCheck makes the server checks of one client (failover names a
// Sentinel group's master), reporting evicting servers to the gauge.
func newServerCheck(logger func() *zap.Logger, failover string) *serverCheck {
	slogger := func() *slog.Logger { return slogFor(logger()) }
	return redisconn.NewCheck(redisconn.CheckOptions{Logger: slogger, Failover: failover, OnEvicting: markEvicting})
}

// evicting counts, per server address, the clients that found it with an
// evicting policy; the gauge is the number of such servers.
var evicting = struct {
	sync.Mutex
	by map[string]map[*serverCheck]bool
}{by: map[string]map[*serverCheck]bool{}}

func markEvicting(sc *serverCheck, addr string, on bool) {
	initMetrics()
	evicting.Lock()
	defer evicting.Unlock()
	if on {
		if evicting.by[addr] == nil {
			evicting.by[addr] = map[*serverCheck]bool{}
		}
		evicting.by[addr][sc] = true
	} else if m := evicting.by[addr]; m != nil {
		delete(m, sc)
		if len(m) == 0 {
			delete(evicting.by, addr)
		}
	}
	evictingServers.Set(float64(len(evicting.by)))
}

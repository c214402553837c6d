package redisratelimit

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) {
	// Two handlers with Redis clients of their own are two instances for
	// fail_local (its heartbeats name the process, else).
	instancePerClient = true
	testkit.Main(m)
}

// testRedis is a real redis-server process for one test (internal/testredis).
type testRedis = testredis.Server

// startRedis starts redis-server (extra args are passed as config, e.g.
// "--requirepass", "secret"); startRedisOnPort starts one on a port chosen
// before (to test "Redis comes up after Caddy"); freePort is a free
// loopback port (internal/testredis). handlerServer serves mw in front of
// next the way Caddy's server does; okHandler answers 200; get sends one
// GET with a bounded client; waitFor polls cond until it holds (true) or d
// passed (false) (internal/testkit).
var (
	startRedis       = testredis.Start
	startRedisOnPort = testredis.StartOnPort
	freePort         = testredis.FreePort
	handlerServer    = testkit.Serve
	okHandler        = testkit.OK
	get              = testkit.Get
	waitFor          = testkit.WaitFor
)

// startCluster starts three redis-server masters in cluster mode on free
// loopback ports and joins them into one Cluster (no replicas).
func startCluster(t *testing.T) []*testRedis {
	t.Helper()
	return testredis.StartCluster(t, 3, 0)
}

// startInterceptProxy forwards TCP connections to target through intercept
// (testredis.InterceptProxy).
func startInterceptProxy(t *testing.T, target string, intercept func(chunk []byte, client, server net.Conn) bool) string {
	t.Helper()
	return testredis.InterceptProxy(t, target, intercept)
}

// provisionRateLimitJSON builds a redis_ratelimit handler from its JSON
// form, provisions it like Caddy would, quiets its logger, and cleans it up
// when the test ends.
func provisionRateLimitJSON(t testing.TB, cfg string) *RedisRateLimit {
	t.Helper()
	h := new(RedisRateLimit)
	testkit.Provision(t, cfg, h)
	quietRateLimit(h)
	return h
}

// quietRateLimit replaces the debug logger that Caddy gives a module
// provisioned without a config (as in these tests) by testkit.QuietLogger.
func quietRateLimit(h *RedisRateLimit) { h.logger = testkit.QuietLogger() }

// newRateLimit provisions a redis_ratelimit handler against r. mod edits the
// config before Provision (the default is 5 requests per second, timeout 5s).
func newRateLimit(t *testing.T, r *testRedis, mod func(h *RedisRateLimit)) *RedisRateLimit {
	t.Helper()
	h, _ := newRateLimitScoped(t, r, mod)
	return h
}

// newRateLimitScoped is newRateLimit for a handler that lives for part of a
// test (a config that a reload drops): the returned function cleans it up
// (once; it also runs when the test ends).
func newRateLimitScoped(t *testing.T, r *testRedis, mod func(h *RedisRateLimit)) (*RedisRateLimit, func()) {
	t.Helper()
	h := &RedisRateLimit{Rates: []Rate{{Requests: 5, Window: caddy.Duration(time.Second)}}}
	h.Addresses = []string{r.Addr}
	// A generous bound, so a loaded machine does not turn decisions into
	// fail-open admissions; fault tests set their own.
	h.Timeout = caddy.Duration(5 * time.Second)
	if mod != nil {
		mod(h)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := h.Provision(ctx); err != nil {
		cancel()
		t.Fatalf("provision: %v", err)
	}
	quietRateLimit(h)
	if err := h.Validate(); err != nil {
		t.Fatalf("validate: %v", err)
	}
	var once sync.Once
	done := func() { once.Do(func() { _ = h.Cleanup(); cancel() }) }
	t.Cleanup(done)
	return h, done
}

// rlAnswer is what one request got.
type rlAnswer struct {
	status  int // 200 when passed on, else the handler error's status
	passed  bool
	header  http.Header
	repl    *caddy.Replacer
	err     error
	elapsed time.Duration
}

// serveRL sends one request from client IP ip through h; prep may edit the
// request (headers) and replacer before the handler runs.
func serveRL(h *RedisRateLimit, ip string, prep func(r *http.Request, repl *caddy.Replacer)) rlAnswer {
	return serveRLWith(context.Background(), h, ip, prep, nil)
}

// serveRLWith is serveRL with the request's context and the next handler
// given (nil next answers 200).
func serveRLWith(ctx context.Context, h *RedisRateLimit, ip string, prep func(r *http.Request, repl *caddy.Replacer), next caddyhttp.HandlerFunc) rlAnswer {
	req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil).WithContext(ctx)
	req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: ip}))
	repl := caddyhttp.NewTestReplacer(req)
	if prep != nil {
		prep(req, repl)
	}
	w := httptest.NewRecorder()
	var a rlAnswer
	n := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		a.passed = true
		if next != nil {
			return next(w, r)
		}
		w.WriteHeader(http.StatusOK)
		return nil
	})
	start := time.Now()
	a.err = h.ServeHTTP(w, req, n)
	a.elapsed = time.Since(start)
	a.header, a.repl, a.status = w.Header(), repl, w.Code
	if a.err != nil {
		var he caddyhttp.HandlerError
		if errors.As(a.err, &he) {
			a.status = he.StatusCode
		} else {
			a.status = -1
		}
	}
	return a
}

// retryAfter returns the Retry-After seconds of a, or -1.
func (a rlAnswer) retryAfter() int {
	v := a.header.Get(HeaderRetryAfter)
	if v == "" {
		return -1
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return -2
	}
	return n
}

var (
	rlPolicyItem = regexp.MustCompile(`^"r(\d+)";q=(\d+);w=(\d+)$`)
	rlStateItem  = regexp.MustCompile(`^"r(\d+)";r=(\d+);t=(\d+)$`)
)

// rlState parses the RateLimit field: policy index, remaining, seconds.
func rlState(t *testing.T, a rlAnswer) (idx, rem, secs int) {
	t.Helper()
	v := a.header.Get(HeaderRateLimit)
	m := rlStateItem.FindStringSubmatch(v)
	if m == nil {
		t.Fatalf("RateLimit field %q does not match %s", v, rlStateItem)
	}
	idx, _ = strconv.Atoi(m[1])
	rem, _ = strconv.Atoi(m[2])
	secs, _ = strconv.Atoi(m[3])
	return
}

// rlCounterValue reads a prometheus counter.
func rlCounterValue(c interface{ Write(*dto.Metric) error }) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return math.NaN()
	}
	return m.GetCounter().GetValue()
}

// rlRingCount reads how many admissions a sliding_window log recorded.
func rlRingCount(t testing.TB, r *testRedis, key string) int {
	t.Helper()
	b, err := r.Client().GetRange(context.Background(), key, 0, 7).Bytes()
	if err != nil || len(b) != 8 {
		t.Fatalf("reading %s: %v (%d bytes)", key, err, len(b))
	}
	return int(math.Float64frombits(binary.BigEndian.Uint64(b)))
}

// rlRingTimes reads the admission times (µs) a sliding_window log holds,
// by admission number.
func rlRingTimes(ctx context.Context, c *redis.Client, key string, n int) (map[int]int64, error) {
	b, err := c.Get(ctx, key).Bytes()
	if err != nil {
		return nil, err
	}
	if len(b) < 24 {
		return nil, fmt.Errorf("log %s too short", key)
	}
	pos := int(math.Float64frombits(binary.BigEndian.Uint64(b)))
	out := make(map[int]int64)
	for j := max(0, pos-n); j < pos; j++ {
		off := 24 + 8*(j%n)
		if off+8 > len(b) {
			return nil, fmt.Errorf("log %s: slot %d missing", key, j%n)
		}
		out[j] = int64(math.Float64frombits(binary.BigEndian.Uint64(b[off : off+8])))
	}
	return out, nil
}

// The algorithms' names in configs.
const (
	algoSliding = "sliding_window"
	algoGCRA    = "gcra"
)

package redisdlm

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddy-dlm/redisdlm/redisratelimit"
)

// The edges of fail_local's bound (docs/ratelimit.md), each with real Caddy
// processes (caddyproc_test.go) in front of a recording upstream: in any
// window of w the fleet admits at most Σ over instances of max(what Redis
// admitted through that instance in the window, its share). An admission
// counts in a window only when its client sent it and the upstream
// received it inside that window: its decision lies between the two.

// flEdgeN is the limit of these tests, 21 per window: a share of 7 over
// three instances.
const flEdgeN = 21

// flArrival is one request the upstream received: when its client sent it
// and when it arrived, and through which instance.
type flArrival struct {
	sent, arrived time.Time
	inst, user    string
}

// flUpstream records every request it receives.
type flUpstream struct {
	mu  sync.Mutex
	got []flArrival
	srv *httptest.Server
}

func startFLUpstream(t *testing.T) *flUpstream {
	t.Helper()
	u := new(flUpstream)
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		at := time.Now()
		sent, err := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
		if err != nil {
			http.Error(w, "no X-Sent", http.StatusBadRequest)
			return
		}
		u.mu.Lock()
		u.got = append(u.got, flArrival{sent: time.UnixMicro(sent), arrived: at, inst: r.Header.Get("X-Inst"), user: r.Header.Get("X-User")})
		u.mu.Unlock()
	}))
	t.Cleanup(u.srv.Close)
	return u
}

// arrivals returns what the upstream received of user, by send time.
func (u *flUpstream) arrivals(user string) []flArrival {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []flArrival
	for _, a := range u.got {
		if a.user == user {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(a, b flArrival) int { return a.sent.Compare(b.sent) })
	return out
}

// flWindow is the busiest window of w in as: the admissions sent at or
// after one admission's send time and received less than w after it.
type flWindow struct {
	from  time.Time
	in    []flArrival
	count int
}

// flWindows visits, for each admission, the window of w that starts at its
// send time.
func flWindows(as []flArrival, w time.Duration, visit func(flWindow)) {
	for i, a := range as {
		win := flWindow{from: a.sent}
		for _, b := range as[i:] {
			if b.sent.Sub(a.sent) >= w {
				break
			}
			if b.arrived.Before(a.sent.Add(w)) {
				win.in = append(win.in, b)
			}
		}
		win.count = len(win.in)
		visit(win)
	}
}

// flBusiest is the largest count of flWindows.
func flBusiest(as []flArrival, w time.Duration) flWindow {
	var best flWindow
	flWindows(as, w, func(win flWindow) {
		if win.count > best.count {
			best = win
		}
	})
	return best
}

// perInstance counts the admissions of a window by instance.
func (w flWindow) perInstance() map[string]int {
	m := map[string]int{}
	for _, a := range w.in {
		m[a.inst]++
	}
	return m
}

// flSite is a Caddyfile of one instance: the limit, 21 per w (with extra
// lines), in front of the upstream, which learns the instance by X-Inst.
// The admin endpoint is on admin (for a reload), or off when admin is 0.
func flSite(dir string, port, admin int, w time.Duration, name, redis, upstream, extra string) string {
	adm := "admin off"
	if admin != 0 {
		adm = fmt.Sprintf("admin localhost:%d", admin)
	}
	return fmt.Sprintf(`{
	%s
	auto_https off
	persist_config off
	storage file_system %s
	log {
		level WARN
	}
}
http://127.0.0.1:%d {
	redis_ratelimit {
		key {http.request.header.X-User}
		rate %d %s
		fail_local
		redis %s
%s	}
	request_header X-Inst %s
	reverse_proxy %s
}
`, adm, dir, port, flEdgeN, w, redis, extra, name, upstream)
}

// flAnswer is what a client got.
type flAnswer struct {
	status     int
	retryAfter string
	err        error
}

var flHTTP = &http.Client{Timeout: 20 * time.Second}

// flSend sends one request of user through c, stamped with its send time.
func flSend(c *caddyProcess, user string) flAnswer {
	req, _ := http.NewRequest(http.MethodGet, c.url()+"/", nil)
	req.Header.Set("X-User", user)
	req.Header.Set("X-Sent", strconv.FormatInt(time.Now().UnixMicro(), 10))
	resp, err := flHTTP.Do(req)
	if err != nil {
		return flAnswer{err: err}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return flAnswer{status: resp.StatusCode, retryAfter: resp.Header.Get(redisratelimit.HeaderRetryAfter)}
}

// flSendN sends n requests of user through c, one after the other, and
// counts the answers by status.
func flSendN(t *testing.T, c *caddyProcess, user string, n int) map[int]int {
	t.Helper()
	out := map[int]int{}
	for range n {
		a := flSend(c, user)
		if a.err != nil {
			t.Fatalf("a request to %s: %v", c.name, a.err)
		}
		out[a.status]++
	}
	return out
}

// reloadCaddy loads caddyfile into c through its admin endpoint.
func reloadCaddy(t *testing.T, c *caddyProcess, admin int, caddyfile string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", admin), bytes.NewReader([]byte(caddyfile)))
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := flHTTP.Do(req)
	if err != nil {
		t.Fatalf("reloading Caddy %s: %v", c.name, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("reloading Caddy %s: %d %s", c.name, resp.StatusCode, body)
	}
}

// fleetCount is the number of live heartbeats under the default prefix.
func fleetCount(t *testing.T, r *testRedis) int64 {
	t.Helper()
	n, _ := r.Client().ZCard(t.Context(), redisratelimit.DefaultRateLimitPrefix+"{~fleet}:instances").Result()
	return n
}

// slidingBefore counts the admissions in Redis's sliding log of key
// stamped before t.
func slidingBefore(t *testing.T, r *testRedis, key string, before time.Time) int {
	t.Helper()
	v, _ := r.Client().Get(t.Context(), key).Bytes()
	n := 0
	for off := 24; off+8 <= len(v); off += 8 {
		if at := int64(math.Float64frombits(binary.BigEndian.Uint64(v[off : off+8]))); at > 0 && at < before.UnixMicro() {
			n++
		}
	}
	return n
}

// waitLog waits until c's log holds msg (after the first line that holds
// after, when after is not "").
func waitLog(c *caddyProcess, msg, after string, d time.Duration) bool {
	return waitFor(d, func() bool {
		b, _ := os.ReadFile(c.log)
		if i := bytes.Index(b, []byte(after)); i >= 0 {
			return bytes.Contains(b[i:], []byte(msg))
		}
		return false
	})
}

// TestWholeCaddyFailLocalReload: `instances 3` (a share
// of 7 of 21 per minute); Redis paused, 15 requests to A, A reloaded with
// its timeout changed (a new Redis client), 15 more. A admits its share, 7,
// over both configs (a reload keeps the local limiter, its counts and its
// pending charges), and once Redis answers again all 7 are charged to it.
func TestWholeCaddyFailLocalReload(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	r := startRedis(t)
	up := startFLUpstream(t)
	port, admin := freePort(t), freePort(t)
	site := func(timeout string) func(string) string {
		return func(dir string) string {
			return flSite(dir, port, admin, time.Minute, "A", r.Addr, up.srv.Listener.Addr().String(), "\t\tinstances 3\n\t\ttimeout "+timeout+"\n")
		}
	}
	a := startCaddyProcess(t, "A", port, site("300ms"))
	if got := flSendN(t, a, "warm", 1); got[200] != 1 {
		t.Fatalf("with Redis up: %v", got)
	}
	r.Pause()
	resumed := false
	defer func() {
		if !resumed {
			r.Resume()
		}
	}()
	before := flSendN(t, a, "u", 15)
	reloadCaddy(t, a, admin, site("400ms")(t.TempDir()))
	after := flSendN(t, a, "u", 15)
	r.Resume()
	resumed = true
	t.Logf("before the reload %v, after it %v", before, after)
	if before[200] != 7 || after[200] != 0 {
		t.Errorf("admitted %d before the reload and %d after it, want the share 7 in all (a reload keeps the local state)", before[200], after[200])
	}
	// Back to Redis: every local admission is charged to it, once. (The
	// call that met the paused Redis may be recorded as it resumes: a
	// stricter window, never a looser one.)
	key := redisratelimit.DefaultRateLimitPrefix + "{u}:sw:21/1m0s"
	if !waitFor(20*time.Second, func() bool {
		flSend(a, "probe") // a request of another key ends local mode
		return testkit.SlidingUsed(t, r.Client(), key, time.Minute) >= 7
	}) {
		t.Errorf("Redis holds %d admissions of the key 20 s after SIGCONT, want the 7 local ones", testkit.SlidingUsed(t, r.Client(), key, time.Minute))
	}
	if !waitLog(a, "local rate limiting (fail_local) ends", "", 20*time.Second) {
		t.Fatal("A not back to Redis 20 s after SIGCONT")
	}
	if used := testkit.SlidingUsed(t, r.Client(), key, time.Minute); used < 7 || used > 7+2 {
		t.Errorf("Redis holds %d admissions of the key, want the 7 local ones (and up to 2 calls that met the paused Redis)", used)
	}
	if b := flBusiest(up.arrivals("u"), time.Minute); b.count > 7 {
		t.Errorf("%d admissions of the key within a minute, want at most the share 7", b.count)
	}
}

// waitFleetSeen waits until the heartbeat set holds n instances and each
// of them has beaten since the last one joined: each has read the count n.
func waitFleetSeen(t *testing.T, r *testRedis, n int) {
	t.Helper()
	key := redisratelimit.DefaultRateLimitPrefix + "{~fleet}:instances"
	// Every instance beats after the last one joined (so each counts all),
	// then once more (so each joiner has seen that it is counted).
	var marks []float64
	ok := waitFor(60*time.Second, func() bool {
		zs, err := r.Client().ZRangeWithScores(t.Context(), key, 0, -1).Result()
		if err != nil || len(zs) != n {
			marks = nil
			return false
		}
		if len(marks) == 0 || zs[0].Score > marks[len(marks)-1] {
			marks = append(marks, zs[len(zs)-1].Score)
		}
		return len(marks) == 3
	})
	if !ok {
		t.Fatalf("the heartbeat set does not hold %d instances that each counted the others 60 s on", n)
	}
}

// flLoad sends a request of user every gap, to the instances in turn,
// until stop is closed; it returns once every request is answered.
func flLoad(cs []*caddyProcess, user string, gap time.Duration, stop <-chan struct{}) (wait func() map[int]int) {
	var mu sync.Mutex
	statuses := map[int]int{}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(gap)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			wg.Add(1)
			go func(c *caddyProcess) {
				defer wg.Done()
				a := flSend(c, user)
				mu.Lock()
				statuses[a.status]++
				mu.Unlock()
			}(cs[i%len(cs)])
		}
	}()
	return func() map[int]int {
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return statuses
	}
}

// flCheckBound fails t when a window of w holds more admissions than
// Σ over the instances of max(what Redis admitted through it in the
// window, share); an admission sent in [localFrom, localTo) counts as
// decided locally (a Redis decision counted so only makes the bound
// stricter). It returns the busiest window and its bound.
func flCheckBound(t *testing.T, as []flArrival, w time.Duration, insts []string, share int, localFrom, localTo time.Time) (busiest, bound int) {
	t.Helper()
	flWindows(as, w, func(win flWindow) {
		via := map[string]int{}
		for _, a := range win.in {
			if a.sent.Before(localFrom) || !a.sent.Before(localTo) {
				via[a.inst]++
			}
		}
		b := 0
		for _, i := range insts {
			b += max(via[i], share)
		}
		if win.count > busiest {
			busiest, bound = win.count, b
		}
		if win.count > b {
			t.Errorf("%d admissions within %v from %s (%v by instance; through Redis %v), want at most Σ max(through Redis, share %d) = %d",
				win.count, w, win.from.Format("15:04:05.000"), win.perInstance(), via, share, b)
		}
	})
	return busiest, bound
}

// TestWholeCaddyFailLocalRestartEmpty: three instances
// (N from the heartbeats: a share of 7 of 21 per 10 s) under 8 requests a
// second in turn; the single Redis is killed mid-window and restarted
// empty 3 s later. Each instance holds what Redis admitted through it
// before the kill; on the new process it stays local for a heartbeat's
// life while it charges those admissions (and its local ones) again, so
// the restart adds nothing: no window holds more than Σ max(through
// Redis, share), 21 for this even load.
func TestWholeCaddyFailLocalRestartEmpty(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	r := startRedis(t)
	up := startFLUpstream(t)
	names := []string{"A", "B", "C"}
	var cs []*caddyProcess
	for _, name := range names {
		port := freePort(t)
		cs = append(cs, startCaddyProcess(t, name, port, func(dir string) string {
			return flSite(dir, port, 0, 10*time.Second, name, r.Addr, up.srv.Listener.Addr().String(), "\t\ttimeout 300ms\n")
		}))
	}
	waitFleetSeen(t, r, len(cs))
	stop := make(chan struct{})
	wait := flLoad(cs, "k", 125*time.Millisecond, stop)
	time.Sleep(5 * time.Second) // mid-window: Redis admitted 21, 7 through each
	killed := time.Now()
	r.Kill()
	time.Sleep(3 * time.Second) // the outage
	r = startRedisOnPort(t, r.Port)
	restarted := time.Now()
	// Each instance goes back to Redis after its hold, and Redis then
	// holds the admissions made before the kill again.
	for _, c := range cs {
		if !waitLog(c, "local rate limiting (fail_local) ends", "redis restarted", 20*time.Second) {
			t.Errorf("Caddy %s not back to Redis 20 s after the restart", c.name)
		}
	}
	back := time.Since(restarted)
	if old := slidingBefore(t, r, redisratelimit.DefaultRateLimitPrefix+"{k}:sw:21/10s", killed); old == 0 {
		t.Error("Redis holds none of the admissions made before the kill: they were not charged again")
	}
	time.Sleep(15*time.Second - back) // past the window after the return
	close(stop)
	statuses := wait()
	as := up.arrivals("k")
	busiest, bound := flCheckBound(t, as, 10*time.Second, names, 7, killed, restarted.Add(ratelimit.HeartbeatLife+3*time.Second))
	t.Logf("statuses %v; %d admissions; busiest window %d (its bound %d)", statuses, len(as), busiest, bound)
	if statuses[200] == 0 || statuses[http.StatusInternalServerError] > 0 || statuses[http.StatusBadGateway] > 0 {
		t.Errorf("statuses %v", statuses)
	}
}

// TestWholeCaddyFailLocalJoin: A joins B (N from the
// heartbeats, 21 per minute), and Redis stops within a second of A's first
// heartbeat, before every instance has read a count with A in it. Then
// both get requests: together they admit no more than N·ceil(n ÷ N) = 22
// for N = 2, whatever N each had read.
func TestWholeCaddyFailLocalJoin(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	r := startRedis(t)
	up := startFLUpstream(t)
	site := func(name string, port int) func(string) string {
		return func(dir string) string {
			return flSite(dir, port, 0, time.Minute, name, r.Addr, up.srv.Listener.Addr().String(), "\t\ttimeout 300ms\n")
		}
	}
	portB := freePort(t)
	b := startCaddyProcess(t, "B", portB, site("B", portB))
	waitFleetSeen(t, r, 1)
	portA := freePort(t)
	a := startCaddyProcess(t, "A", portA, site("A", portA))
	if !waitFor(30*time.Second, func() bool { return fleetCount(t, r) == 2 }) {
		t.Fatal("A has no heartbeat 30 s after it started")
	}
	r.Pause()
	defer r.Resume()
	got := map[string]map[int]int{"A": {}, "B": {}}
	for range 20 {
		for _, c := range []*caddyProcess{a, b} {
			x := flSend(c, "j")
			if x.err != nil {
				t.Fatalf("a request to %s: %v", c.name, x.err)
			}
			got[c.name][x.status]++
		}
	}
	t.Logf("A %v, B %v", got["A"], got["B"])
	if got["A"][200] > 11 {
		t.Errorf("A admitted %d, more than its share 11 of N = 2", got["A"][200])
	}
	if n := got["A"][200] + got["B"][200]; n > 22 {
		t.Errorf("%d admitted through A and B during the outage, want at most N·ceil(n ÷ N) = 22", n)
	}
	if got["A"][200]+got["B"][200] == 0 {
		t.Error("nothing admitted during the outage: never none")
	}
}

// TestWholeCaddyFailLocalUneven: three instances (N from
// the heartbeats: a share of 7 of 21 per minute); 30 requests to A, of
// which Redis admits 21; Redis stops; 20 requests each to B and C, and 10
// more to A. Each instance admits at most max(what Redis admitted through
// it, its share): A nothing more, B and C 7 each, so the window holds
// 35 = 21 + 7 + 7, the bound for uneven load, n + (N−1)·ceil(n ÷ N).
func TestWholeCaddyFailLocalUneven(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	r := startRedis(t)
	up := startFLUpstream(t)
	names := []string{"A", "B", "C"}
	cs := map[string]*caddyProcess{}
	for _, name := range names {
		port := freePort(t)
		cs[name] = startCaddyProcess(t, name, port, func(dir string) string {
			return flSite(dir, port, 0, time.Minute, name, r.Addr, up.srv.Listener.Addr().String(), "\t\ttimeout 300ms\n")
		})
	}
	waitFleetSeen(t, r, len(cs))
	if got := flSendN(t, cs["A"], "x", 30); got[200] != flEdgeN {
		t.Fatalf("through Redis: %v, want %d admitted", got, flEdgeN)
	}
	stopped := time.Now()
	r.Pause()
	defer r.Resume()
	got := map[string]map[int]int{"B": flSendN(t, cs["B"], "x", 20), "C": flSendN(t, cs["C"], "x", 20), "A": flSendN(t, cs["A"], "x", 10)}
	t.Logf("while Redis is stopped: A %v, B %v, C %v", got["A"], got["B"], got["C"])
	if got["A"][200] != 0 || got["B"][200] > 7 || got["C"][200] > 7 {
		t.Errorf("admitted locally: A %d, B %d, C %d; want A none (Redis admitted 21 through it), B and C at most their share 7",
			got["A"][200], got["B"][200], got["C"][200])
	}
	if got["B"][200]+got["C"][200] == 0 {
		t.Error("nothing admitted while Redis is stopped: never none")
	}
	busiest, bound := flCheckBound(t, up.arrivals("x"), time.Minute, names, 7, stopped, stopped.Add(time.Hour))
	if busiest > flEdgeN+2*7 {
		t.Errorf("%d admissions in a minute, want at most n + (N−1)·ceil(n ÷ N) = 35", busiest)
	}
	t.Logf("busiest window %d (its bound %d)", busiest, bound)
}

// TestWholeCaddyFailLocalRestartReturn: the end of the hold after Redis
// restarted empty is a return from local mode like any other. Three
// instances (`instances 3`: a share of 7 of 21 per minute), each behind a
// proxy of its own; Redis is killed, and each instance admits its share
// locally: 21 in the window. Redis comes back empty, reachable for A only
// (B and C hold their 14 admissions uncharged, as instances whose hold
// has not ended yet still decide locally). A charges its 7 again during
// its hold; when the hold ends, A's first request is the first Redis
// decision after local mode, and Redis, knowing only A's 7, would admit
// it. It must be held to A's share, spent, as every request is for a
// second after a return: a 429, and the window keeps 21 = Σ max(through
// Redis, share). Once B and C are back and have charged theirs, Redis
// holds the fleet's 21 and admits nothing more in the window.
func TestWholeCaddyFailLocalRestartReturn(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	r := startRedis(t)
	up := startFLUpstream(t)
	names := []string{"A", "B", "C"}
	cs := map[string]*caddyProcess{}
	ps := map[string]*testredis.CutProxy{}
	for _, name := range names {
		port := freePort(t)
		ps[name] = testredis.StartCutProxy(t, r.Addr)
		cs[name] = startCaddyProcess(t, name, port, func(dir string) string {
			return flSite(dir, port, 0, time.Minute, name, ps[name].Addr, up.srv.Listener.Addr().String(), "\t\tinstances 3\n\t\ttimeout 300ms\n")
		})
	}
	for _, name := range names {
		if got := flSendN(t, cs[name], "warm", 1); got[200] != 1 {
			t.Fatalf("Caddy %s with Redis up: %v", name, got)
		}
	}
	killed := time.Now()
	r.Kill()
	for _, name := range names {
		if got := flSendN(t, cs[name], "k", 10); got[200] != 7 {
			t.Fatalf("Caddy %s with Redis down: %v, want its share 7 admitted", name, got)
		}
	}
	ps["B"].Cut.Store(true)
	ps["C"].Cut.Store(true)
	restarting := time.Now()
	r = startRedisOnPort(t, r.Port)
	// A sees the new process (its heartbeat, tried every 100 ms while
	// local) and charges its 7 again; its hold ends a heartbeat's life
	// after it saw the restart, which it logs.
	if !waitLog(cs["A"], "redis restarted", "", 20*time.Second) {
		t.Fatal("Caddy A did not see the restart 20 s after it")
	}
	seen := time.Now()
	key := redisratelimit.DefaultRateLimitPrefix + "{k}:sw:21/1m0s"
	if !waitFor(20*time.Second, func() bool { return testkit.SlidingUsed(t, r.Client(), key, time.Minute) >= 7 }) {
		t.Fatalf("Redis holds %d admissions of the key, want A's 7 charged again", testkit.SlidingUsed(t, r.Client(), key, time.Minute))
	}
	time.Sleep(time.Until(seen.Add(ratelimit.HeartbeatLife))) // A's hold is over
	probe := flSend(cs["A"], "k")
	answered := time.Now()
	// A saw the restart after restarting began, so its return's second
	// lasts at least until then + ratelimit.HeartbeatLife + redisratelimit.ReturnCap. (A machine
	// stalled past it lets Redis decide alone, and Redis knows only A's 7:
	// then nothing is asserted of this answer.)
	within := answered.Before(restarting.Add(ratelimit.HeartbeatLife + redisratelimit.ReturnCap))
	t.Logf("A's first request after its hold: %d, Retry-After %q (answered %v after restarting began)", probe.status, probe.retryAfter, answered.Sub(restarting).Round(time.Millisecond))
	if within && probe.status != http.StatusTooManyRequests {
		t.Errorf("A's first request after its hold: %d, want 429 (its share is spent; Redis knows only A's 7 of the window's 21)", probe.status)
	}
	ps["B"].Cut.Store(false)
	ps["C"].Cut.Store(false)
	if !waitFor(20*time.Second, func() bool { return testkit.SlidingUsed(t, r.Client(), key, time.Minute) >= flEdgeN }) {
		t.Errorf("Redis holds %d admissions of the key 20 s after B and C came back, want the fleet's 21", testkit.SlidingUsed(t, r.Client(), key, time.Minute))
	}
	for _, name := range []string{"B", "C"} {
		if !waitLog(cs[name], "redis restarted", "", 20*time.Second) {
			t.Errorf("Caddy %s did not see the restart 20 s after it could", name)
		}
	}
	time.Sleep(ratelimit.HeartbeatLife + redisratelimit.ReturnCap) // B's and C's holds and returns are over
	after := map[string]map[int]int{}
	for _, name := range names {
		after[name] = flSendN(t, cs[name], "k", 3)
	}
	t.Logf("after every return: A %v, B %v, C %v", after["A"], after["B"], after["C"])
	for _, name := range names {
		if after[name][200] != 0 {
			t.Errorf("Caddy %s after every return admitted %d, want none (Redis holds the window's 21)", name, after[name][200])
		}
	}
	if !within {
		t.Log("A's first request came after its return's second: its answer and the window are not checked")
		return
	}
	busiest, bound := flCheckBound(t, up.arrivals("k"), time.Minute, names, 7, killed, answered)
	t.Logf("busiest window %d (its bound %d)", busiest, bound)
}

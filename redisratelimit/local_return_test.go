package redisratelimit

import (
	"encoding/binary"
	"io"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/caddyserver/caddy/v2"
)

// The return from local mode (fail_local): what Redis cannot know yet, and
// when it learns it.

// sharesSpentApart starts two fail_local instances (instances 2: a share
// of 5 of 10 per minute), each behind a proxy to one Redis; both decide
// once with Redis up (on warm, another key, so their clients are ready),
// then Redis is cut from both and each admits its share of ip locally.
func sharesSpentApart(t *testing.T, ip, warm string) (r *testRedis, pa, pb *testredis.CutProxy, a, b *RedisRateLimit) {
	t.Helper()
	r = startRedis(t)
	pa, pb = testredis.StartCutProxy(t, r.Addr), testredis.StartCutProxy(t, r.Addr)
	inst := func(p *testredis.CutProxy) *RedisRateLimit {
		return newRateLimit(t, r, func(h *RedisRateLimit) {
			h.Addresses = []string{p.Addr}
			h.FailLocal, h.Instances = true, 2
			h.Timeout = caddy.Duration(300 * time.Millisecond)
			h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
		})
	}
	a, b = inst(pa), inst(pb)
	if !serveRL(a, warm, nil).passed || !serveRL(b, warm, nil).passed {
		t.Fatal("with Redis up: not admitted")
	}
	pa.Cut.Store(true)
	pb.Cut.Store(true)
	for _, h := range []*RedisRateLimit{a, b} {
		if passed, statuses := countPassed(h, ip, 8); passed != 5 {
			t.Fatalf("locally: %d of 8 admitted (%v), want the share 5", passed, statuses)
		}
	}
	return r, pa, pb, a, b
}

// TestFailLocalReturnCap: two instances (instances 2: a share of 5 of
// 10 per minute) decide locally while Redis is unreachable from both, and
// each admits its share. Redis comes back for A only; B, still cut off,
// holds its 5 admissions uncharged. Redis knows only A's 5, so without the
// cap it would admit A 5 more: 15 in the window. For ReturnCap after its
// return A holds the key to its share as well (0 left), so nothing more
// passes; once B is back and has charged, Redis holds all 10 and decides
// alone: still nothing more passes, exactly 10 in the window.
func TestFailLocalReturnCap(t *testing.T) {
	t.Parallel()
	const ip = "192.0.2.60"
	_, pa, pb, a, b := sharesSpentApart(t, ip, "192.0.2.61")
	pa.Cut.Store(false)
	// A is back once a decision by Redis ended its local mode and its
	// admissions are charged (another key probes).
	if !waitFor(10*time.Second, func() bool {
		serveRL(a, "192.0.2.62", nil)
		return !a.local.mode.Load() && !a.local.lim.Pending()
	}) {
		t.Fatal("A not back 10s after Redis came back for it")
	}
	back := time.Unix(0, a.local.back.Load())
	passed, statuses := countPassed(a, ip, 5)
	if since := time.Since(back); since < ReturnCap && passed != 0 {
		t.Errorf("A within %v of its return: %d of 5 admitted (%v), want 0 (its share is spent; B's 5 are not charged yet)", since, passed, statuses)
	}
	// (A machine that stalled past the cap may have let Redis admit more:
	// the log holds at most n.)
	if views, _, _, found, err := a.peekQuota(t.Context(), ip); err != nil || !found || views[0].Used != min(10, 5+int64(passed)) {
		t.Errorf("Redis holds %+v (%v, %v), want A's 5 and what passed since", views, found, err)
	}
	pb.Cut.Store(false)
	if !waitFor(10*time.Second, func() bool {
		serveRL(b, "192.0.2.62", nil)
		return !b.local.mode.Load() && !b.local.lim.Pending()
	}) {
		t.Fatal("B not back 10s after Redis came back for it")
	}
	time.Sleep(time.Until(time.Unix(0, max(a.local.back.Load(), b.local.back.Load())).Add(ReturnCap)))
	if views, _, _, found, err := a.peekQuota(t.Context(), ip); err != nil || !found || views[0].Used != 10 {
		t.Errorf("with both back, Redis holds %+v (%v, %v), want both shares, 10", views, found, err)
	}
	for _, h := range []*RedisRateLimit{a, b} {
		if more, statuses := countPassed(h, ip, 3); more != 0 || statuses[429] != 3 {
			t.Errorf("after the cap: %d of 3 admitted (%v), want 3 × 429 from Redis", more, statuses)
		}
	}
}

// TestFailLocalProbeHeld: the first Redis decision after local mode (the
// breaker's probe) belongs to the return as well. Two instances
// (instances 2: a share of 5 of 10 per minute) each admit their share
// while Redis is unreachable from both; Redis comes back for A only, A's
// heartbeat is answered and its 5 are charged, and A's next request of the
// key, still in local mode, is the first to reach Redis. Redis knows only
// A's 5 and would admit it: 11 in the window, one more than A's share
// beside B's. Held to A's spent share, it gets the local 429.
func TestFailLocalProbeHeld(t *testing.T) {
	t.Parallel()
	const ip = "192.0.2.67"
	r, pa, _, a, _ := sharesSpentApart(t, ip, "192.0.2.68")
	uncut := time.Now()
	pa.Cut.Store(false)
	// A's fleet loop charges its 5 once its heartbeat is answered; no
	// request has reached Redis yet, so A is still in local mode.
	key := a.localRates(ip, &a.static)[0].Key
	if !waitFor(10*time.Second, func() bool {
		return testkit.SlidingUsed(t, r.Client(), key, time.Minute) == 5 && !a.local.lim.Pending()
	}) {
		t.Fatalf("A's 5 not charged 10s after Redis came back for it (Redis holds %d)", testkit.SlidingUsed(t, r.Client(), key, time.Minute))
	}
	if !a.local.mode.Load() {
		t.Fatal("A left local mode with no Redis decision")
	}
	got := serveRL(a, ip, nil)
	// The return began when A's heartbeat was answered, after uncut: a
	// machine stalled past its second lets Redis decide alone.
	if time.Since(uncut) < ReturnCap && (got.passed || got.status != 429) {
		t.Errorf("A's first request back to Redis: passed %v, status %d; want the local 429 (A's share is spent, B's 5 are not charged)", got.passed, got.status)
	}
	if used := testkit.SlidingUsed(t, r.Client(), key, time.Minute); time.Since(uncut) < ReturnCap && used != 5 {
		t.Errorf("Redis holds %d admissions of the key, want A's 5 (the probe held before Redis)", used)
	}
}

// replyDelayProxy forwards TCP connections to target, holding back each
// chunk of Redis's replies by delay while armed (Redis runs a call at once,
// its answer comes late); cut closes every connection, and new ones at
// once, until it is undone (nothing reaches Redis meanwhile).
type replyDelayProxy struct {
	addr  string
	armed atomic.Bool
	mu    sync.Mutex
	down  bool
	conns []net.Conn
}

func (p *replyDelayProxy) cut(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

func startReplyDelayProxy(t *testing.T, target string, delay time.Duration) *replyDelayProxy {
	t.Helper()
	p := new(replyDelayProxy)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close(); p.cut(true) })
	p.addr = ln.Addr().String()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			if p.down {
				p.mu.Unlock()
				c.Close()
				continue
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				p.mu.Unlock()
				c.Close()
				continue
			}
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go func() { io.Copy(s, c); s.Close() }()
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := s.Read(buf)
					if n > 0 {
						if p.armed.Load() {
							time.Sleep(delay)
						}
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						c.Close()
						return
					}
				}
			}()
		}
	}()
	return p
}

// TestFailLocalChargeStampsNotEarly: local admissions are charged at their
// own times converted to Redis time, with the clock offset learnt from
// Redis's admissions. Here every answer, also after the outage, comes
// 60 ms after Redis ran the call (Redis on this host: its TIME is the local clock), so an offset
// taken from the middle of the round trip would be 30 ms short, and the
// charges would land 30 ms earlier than the admissions happened: Redis
// would forget them early and admit again before a window had passed. The
// latest charged admission must be stamped no earlier than the request
// that made it was sent.
func TestFailLocalChargeStampsNotEarly(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	p := startReplyDelayProxy(t, r.Addr, 60*time.Millisecond)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Addresses = []string{p.addr}
		h.FailLocal, h.Instances = true, 1
		h.Timeout = caddy.Duration(time.Second)
		h.Rates = []Rate{{Requests: 100, Window: caddy.Duration(time.Minute)}}
	})
	const ip = "192.0.2.63"
	p.armed.Store(true)
	if passed, statuses := countPassed(h, ip, 3); passed != 3 {
		t.Fatalf("with Redis up: %d of 3 admitted (%v)", passed, statuses)
	}
	p.cut(true) // nothing reaches Redis: it runs no call late
	var lastSent time.Time
	for i := 0; i < 4; i++ {
		sent := time.Now()
		if a := serveRL(h, ip, nil); a.passed && a.elapsed < time.Second {
			lastSent = sent // decided locally
		}
	}
	if lastSent.IsZero() {
		t.Fatal("nothing admitted locally while Redis was cut off")
	}
	p.cut(false) // the answers still come late: every offset learnt is as far off
	if !waitFor(10*time.Second, func() bool {
		serveRL(h, "192.0.2.64", nil)
		return !h.local.mode.Load() && !h.local.lim.Pending()
	}) {
		t.Fatal("local admissions not charged 10s after Redis came back")
	}
	v, err := r.Client().Get(t.Context(), h.localRates(ip, &h.static)[0].Key).Bytes()
	if err != nil || len(v) < 24 {
		t.Fatalf("the key's log: %q, %v", v, err)
	}
	last := int64(math.Float64frombits(binary.BigEndian.Uint64(v[16:24])))
	if early := lastSent.UnixMicro() - last; early > 0 {
		t.Errorf("the latest charged admission is stamped %v before its request was sent", time.Duration(early)*time.Microsecond)
	}
}

// TestFailLocalEndsWithSpentShare: an instance whose only key has spent
// its share locally still goes back to Redis once Redis answers (the
// return's hold keeps the probe to the spent share only for a second from
// the heartbeat answered again; then the probe reaches Redis), and Redis
// admits what is left of the quota. (A cap on the probe with no end would
// keep local mode and the share until the local window freed a place, here
// a minute.)
func TestFailLocalEndsWithSpentShare(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	p := testredis.StartCutProxy(t, r.Addr)
	h := newRateLimit(t, r, func(h *RedisRateLimit) {
		h.Addresses = []string{p.Addr}
		h.FailLocal, h.Instances = true, 2
		h.Timeout = caddy.Duration(300 * time.Millisecond)
		h.Rates = []Rate{{Requests: 10, Window: caddy.Duration(time.Minute)}}
	})
	const ip = "192.0.2.65"
	if !serveRL(h, "192.0.2.66", nil).passed {
		t.Fatal("with Redis up: not admitted")
	}
	p.Cut.Store(true)
	if passed, statuses := countPassed(h, ip, 7); passed != 5 {
		t.Fatalf("locally: %d of 7 admitted (%v), want the share 5", passed, statuses)
	}
	p.Cut.Store(false)
	// Only this key's requests: they alone can end local mode.
	passed := 0
	if !waitFor(10*time.Second, func() bool {
		if serveRL(h, ip, nil).passed {
			passed++
		}
		return passed > 0
	}) {
		t.Fatalf("10s after Redis came back: nothing admitted (local mode %v, Redis holds the quota's 5 more)", h.local.mode.Load())
	}
	if h.local.mode.Load() {
		t.Error("admitted, but local mode did not end")
	}
}

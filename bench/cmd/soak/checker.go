package main

// The independent checker: the upstream every Caddy proxies to. It knows
// nothing of Redis or of the plugin; it sees requests arrive and leave and
// asserts what the plugin promises:
//
//   - lock routes: at most `permits` requests of one key inside at once
//     (1, or 2 on /p/ and /rp/), over all four Caddy instances;
//   - fencing tokens: every request carries one, above the token of every
//     request of the same key that left the upstream before this one's
//     client sent it (that one acquired earlier); with permits 1 also above
//     every token seen before for that key (strictly increasing in the
//     order the upstream sees them), and no token is inside twice;
//   - the fencing tier (/f/ and /w/, fence.go): no stale write is stored;
//   - rate-limited routes: the upstream's monotonic clock records each
//     admission; afterwards every window of length w holds at most n of
//     them, less a tolerance for the transit time between Redis deciding
//     and the upstream seeing it (-tolerance).
//
// Events are stamped with the soak's clock and classified at the end
// against the windows of documented exceptions (see faults.go).

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// event is one broken promise as the upstream saw it.
type event struct {
	at      time.Duration // soak clock
	inside  []*holder     // overlap: who was inside when it entered
	me      *holder       // overlap, token: the request that entered
	until   time.Duration // rate: the end of the proven window (a fault in [at, until] excuses it)
	what    string        // "overlap", "token"
	backend string        // which Redis decided: "single", "redlock", "ratelimit"
	key     string
	detail  string
}

// holder is a request inside the upstream.
type holder struct {
	inst     string
	tok      int64
	entry    time.Duration
	hold     string
	canceler bool          // its client meant to give up (X-Cancel)
	giveUp   time.Duration // soak clock: when its client gave up (X-Sent + X-Cancel)
	canceled bool          // its upstream context ended before the hold did
	exit     time.Duration // 0 while inside
}

type keyState struct {
	inside    map[int64]int // token → requests inside with it
	holders   map[*holder]struct{}
	n         int
	lastSeen  int64
	maxExited int64
	exits     []exitRec // in the order they left
}

// exitRec: a request of the key left at wall (Unix µs); maxTok is the
// highest token of it and of every request that left before it.
type exitRec struct {
	wall   int64
	maxTok int64
}

// maxLeftBefore is the highest token of the requests that left before
// wall (Unix µs), or -1.
func (ks *keyState) maxLeftBefore(wall int64) int64 { return maxBefore(ks.exits, wall) }

// maxBefore is the highest token of the records before wall (Unix µs), or -1.
func maxBefore(recs []exitRec, wall int64) int64 {
	i := sort.Search(len(recs), func(i int) bool { return recs[i].wall >= wall })
	if i == 0 {
		return -1
	}
	return recs[i-1].maxTok
}

type checker struct {
	start time.Time
	srv   *http.Server
	url   string

	mu     sync.Mutex
	keys   map[string]*keyState
	admits map[string][]time.Duration // rate-limited key → admission times (upstream clock)
	bounds map[string][]bound         // rate-limited key → when Redis can have admitted each
	events []event
	rlLog  []string       // every admission, for -keep
	served map[string]int // route → requests served

	// The fencing tier (fence.go).
	fenceURL  func() string // a Caddy to send a write to
	fence     fenceStats
	fenceKeys map[string]*fenceKey
	late      sync.WaitGroup // late writes still to send

	fl   flState   // the fail_local tier (faillocal.go)
	once onceState // the execute-once tier (once.go)
}

func startChecker(start time.Time) (*checker, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	c := &checker{start: start, url: l.Addr().String(), keys: map[string]*keyState{},
		admits: map[string][]time.Duration{}, bounds: map[string][]bound{}, served: map[string]int{},
		fence: fenceStats{sent: map[string]map[int]int{}}, fenceKeys: map[string]*fenceKey{}}
	c.srv = &http.Server{Handler: c, ReadHeaderTimeout: 10 * time.Second}
	go c.srv.Serve(l)
	return c, nil
}

func (c *checker) now() time.Duration { return time.Since(c.start) }

// route is the first path segment: s, r, p, rp, stall, f, w, rl, bad, probe.
func route(path string) string {
	seg, _, _ := strings.Cut(strings.TrimPrefix(path, "/"), "/")
	return seg
}

// backendOf names the Redis that decides a route.
func backendOf(rt string) string {
	switch rt {
	case "r", "rp", "probe":
		return "redlock"
	case "rl":
		return "ratelimit"
	}
	return "single"
}

func (c *checker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rt := route(r.URL.Path)
	key := r.URL.Path
	c.mu.Lock()
	c.served[rt]++
	if rt == "once" && r.Method == http.MethodPost {
		c.onceRun(key, r.Header.Get("X-Instance"))
	}
	if rt == "rl" {
		c.admits[key] = append(c.admits[key], c.now())
		sent, err1 := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
		ms, err2 := strconv.ParseInt(r.Header.Get("X-Admitted"), 10, 64)
		if err1 == nil && err2 == nil {
			c.bounds[key] = append(c.bounds[key], bound{lo: sent, hi: ms*1000 + 1000})
		} else {
			c.events = append(c.events, event{at: c.now(), what: "rate", backend: "ratelimit", key: key, detail: "no X-Sent/X-Admitted"})
		}
		c.rlLog = append(c.rlLog, fmt.Sprintf("%.6f %s caddy%s %s", c.now().Seconds(), key, r.Header.Get("X-Instance"), r.Header.Get("X-Admitted")))
		c.mu.Unlock()
		w.Write([]byte("ok"))
		return
	}
	if rt == "fl" {
		sent, err1 := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
		ms, err2 := strconv.ParseInt(r.Header.Get("X-Admitted"), 10, 64)
		if key == "/fl/k0" && err1 == nil && err2 == nil {
			c.flAdmit(sent, ms, r.Header.Get("X-Instance"))
		}
		c.mu.Unlock()
		w.Write([]byte("ok"))
		return
	}
	if rt == "w" {
		c.mu.Unlock()
		c.store(w, r)
		return
	}
	if rt == "bad" { // must never get here: the key is empty
		c.events = append(c.events, event{at: c.now(), what: "bad request served", backend: "single", key: key})
		c.mu.Unlock()
		w.Write([]byte("ok"))
		return
	}
	permits := 1
	if rt == "p" || rt == "rp" {
		permits = 2
	}
	tok, err := strconv.ParseInt(r.Header.Get("Lock-Fencing-Token"), 10, 64)
	ks := c.keys[key]
	if ks == nil {
		ks = &keyState{inside: map[int64]int{}, holders: map[*holder]struct{}{}, lastSeen: -1, maxExited: -1}
		c.keys[key] = ks
	}
	at := c.now()
	var me *holder
	ev := func(what, detail string) {
		c.events = append(c.events, event{at: at, what: what, backend: backendOf(rt), key: key, detail: detail, me: me})
	}
	me = &holder{inst: r.Header.Get("X-Instance"), tok: tok, entry: at, hold: r.Header.Get("X-Hold"), canceler: r.Header.Get("X-Cancel") != ""}
	if me.canceler {
		after, _ := time.ParseDuration(r.Header.Get("X-Cancel"))
		sentAt, _ := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
		me.giveUp = time.Duration(sentAt-c.start.UnixMicro())*time.Microsecond + after
	}
	if ks.n >= permits {
		var in []*holder
		for h := range ks.holders {
			in = append(in, h)
		}
		ev("overlap", fmt.Sprintf("caddy%s token %d hold %s (permits %d)", me.inst, tok, me.hold, permits))
		c.events[len(c.events)-1].inside = in
	}
	sent, _ := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
	switch before := ks.maxLeftBefore(sent); {
	case err != nil:
		ev("token", fmt.Sprintf("no fencing token (%q)", r.Header.Get("Lock-Fencing-Token")))
	case tok <= before:
		// Sound for any permits: that request acquired before it left,
		// which was before this one was even sent.
		ev("token", fmt.Sprintf("token %d not above %d of a request that left before this one was sent", tok, before))
	case permits == 1 && tok <= ks.maxExited:
		ev("token", fmt.Sprintf("token %d not above %d of a request that already left", tok, ks.maxExited))
	case permits == 1 && tok <= ks.lastSeen:
		ev("token", fmt.Sprintf("token %d not above the last one seen, %d", tok, ks.lastSeen))
	case ks.inside[tok] > 0:
		ev("token", fmt.Sprintf("token %d held twice", tok))
	}
	ks.n++
	ks.inside[tok]++
	ks.holders[me] = struct{}{}
	if tok > ks.lastSeen {
		ks.lastSeen = tok
	}
	c.mu.Unlock()

	hold, _ := time.ParseDuration(r.Header.Get("X-Hold"))
	t := time.NewTimer(hold)
	select {
	case <-t.C:
	case <-r.Context().Done(): // the lease was lost (on_lost cancel), the client went away or Caddy died
		t.Stop()
	}
	// The fencing tier: a write while the lock is held, or a late one.
	status, late := http.StatusOK, time.Duration(0)
	if rt == "f" {
		status, late = c.holderWrite(r, key)
	}

	c.mu.Lock()
	me.canceled = r.Context().Err() != nil
	me.exit = c.now()
	ks.n--
	delete(ks.holders, me)
	if ks.inside[tok]--; ks.inside[tok] == 0 {
		delete(ks.inside, tok)
	}
	if tok > ks.maxExited {
		ks.maxExited = tok
	}
	ks.exits = append(ks.exits, exitRec{wall: time.Now().UnixMicro(), maxTok: ks.maxExited})
	c.mu.Unlock()
	if late > 0 {
		c.lateWrite(key, r.Header.Get("Lock-Fencing-Token"), late)
	}
	w.WriteHeader(status)
	w.Write([]byte("ok"))
}

// exCanceled: the holders inside were requests whose client went away;
// Caddy's proxy stopped at once and the lock passed on, while the upstream
// learned of it (the connection closing) only a moment later.
const exCanceled = "client went away mid-request: lock passed on before the upstream noticed"

// exStale: the request that entered was one whose client had gone away:
// Caddy's proxy gave up on it and the lock passed on, and its bytes reached
// the upstream only after the next holder's. Its token is the lower one, so
// an upstream that checks fencing tokens refuses it: the stale writer the
// token exists for.
const exStale = "client went away mid-request: its request reached the upstream after the next holder's (a stale writer with the lower token)"

// staleExcuse names exStale when the request that entered was a canceling
// client's, entered after that client gave up, and left within 10 ms.
func staleExcuse(e event) string {
	if m := e.me; m != nil && m.canceler && m.giveUp <= m.entry && m.exit > 0 && m.exit <= m.entry+10*time.Millisecond {
		return exStale
	}
	return ""
}

// overlapExcuse names exCanceled when every holder inside was such a
// request and left within 10 ms of the newcomer's entry, or exStale.
func overlapExcuse(e event) string {
	if x := staleExcuse(e); x != "" {
		return x
	}
	if len(e.inside) == 0 {
		return ""
	}
	// The client of every holder inside had given up before the newcomer
	// entered (the upstream need not have noticed yet: its own hold may
	// end first), and each left within 10 ms.
	for _, h := range e.inside {
		if !h.canceler || h.giveUp > e.at || h.exit == 0 || h.exit > e.at+10*time.Millisecond {
			return ""
		}
	}
	return exCanceled
}

// describe is e's detail with who was inside and when they left.
func (e event) describe() string {
	var in []string
	for _, h := range e.inside {
		left := "still inside"
		if h.exit > 0 {
			left = fmt.Sprintf("left %+.1fms after", float64(h.exit-e.at)/1e6)
		}
		in = append(in, fmt.Sprintf("caddy%s token %d since %.3fs hold %s canceler=%v canceled=%v %s",
			h.inst, h.tok, h.entry.Seconds(), h.hold, h.canceler, h.canceled, left))
	}
	if len(in) == 0 {
		return e.detail
	}
	return e.detail + " entered while inside: " + strings.Join(in, "; ")
}

// bound: Redis admitted a request between the client sending it (lo, the
// client's X-Sent) and Caddy passing it on (hi, {time.now.unix_ms} stamped
// right after redis_ratelimit, rounded up), Unix µs on the one host clock.
type bound struct{ lo, hi int64 }

// rateEvents proves violations: n+1 admissions whose bounds all lie in an
// interval shorter than w must have been admitted within less than w in
// Redis time, whatever the transit times. It returns the admissions
// checked and the tightest such interval seen (w when none was tighter).
func (c *checker) rateEvents(n int, w time.Duration) (checked int, tightest time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	tightest = w
	wu := w.Microseconds()
	for key, bs := range c.bounds {
		sort.Slice(bs, func(i, j int) bool { return bs[i].lo < bs[j].lo })
		checked += len(bs)
		for i, a := range bs {
			// Requests sent no earlier than a and decided surely within w of a.lo.
			var his []int64
			for _, b := range bs[i:] {
				if b.lo-a.lo >= wu {
					break
				}
				if b.hi-a.lo < wu {
					his = append(his, b.hi)
				}
			}
			if len(his) < n+1 {
				continue
			}
			sort.Slice(his, func(x, y int) bool { return his[x] < his[y] })
			span := time.Duration(his[n]-a.lo) * time.Microsecond
			if span < tightest {
				tightest = span
			}
			from := time.Duration(a.lo)*time.Microsecond - time.Duration(c.start.UnixMicro())*time.Microsecond
			c.events = append(c.events, event{at: from, until: from + span,
				what: "rate", backend: "ratelimit", key: key,
				detail: fmt.Sprintf("%d admissions surely within %v (limit %d per %v)", n+1, span, n, w)})
		}
	}
	return checked, tightest
}

// apparentRate counts, on the upstream's own clock, windows in which
// more than n admissions arrived within w − tol: transit noise between
// Redis and the upstream shows up here, so it is printed, not failed.
func (c *checker) apparentRate(n int, w, tol time.Duration) (count int, tightest time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	tightest = w
	for _, ts := range c.admits {
		sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
		for j := n; j < len(ts); j++ {
			d := ts[j] - ts[j-n]
			if d < w-tol {
				count++
			}
			if d < tightest {
				tightest = d
			}
		}
	}
	return count, tightest
}

// flushConns closes the upstream's idle keep-alive connections (so that
// Caddy's goroutines for them end) and lets new ones be made again.
func (c *checker) flushConns() {
	c.srv.SetKeepAlivesEnabled(false)
	time.Sleep(300 * time.Millisecond)
	c.srv.SetKeepAlivesEnabled(true)
}

func (c *checker) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c.srv.Shutdown(ctx)
}

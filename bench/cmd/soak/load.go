package main

// The clients: workers that keep every route busy on random instances,
// clients that cancel while waiting, and stalled requests; every answer is
// checked against the documented statuses.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"
)

var transport = &http.Transport{
	Proxy:               nil,
	DialContext:         (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
	MaxIdleConns:        256,
	MaxIdleConnsPerHost: 64,
	IdleConnTimeout:     30 * time.Second,
	DisableCompression:  true,
}

var httpClient = &http.Client{Transport: transport, Timeout: 20 * time.Second}

// transportErr is a request that got no HTTP answer.
type transportErr struct {
	inst     int
	from, to time.Duration
	err      string
}

type tally struct {
	mu         sync.Mutex
	requests   map[string]int // route → sent
	statuses   map[int]int
	canceled   int
	bad        map[string]int // unexpected answer → count
	badSamples []string
	tErrs      []transportErr
	lat        []time.Duration
}

func newTally() *tally {
	return &tally{requests: map[string]int{}, statuses: map[int]int{}, bad: map[string]int{}}
}

func (t *tally) unexpected(what, sample string) {
	t.bad[what]++
	if len(t.badSamples) < 20 {
		t.badSamples = append(t.badSamples, sample)
	}
}

// do sends one GET to instance inst and checks the answer. cancelAfter > 0
// makes the client give up after that long (counted as a cancel).
func (s *soak) do(inst int, path string, hold, cancelAfter time.Duration) {
	s.doLate(inst, path, hold, cancelAfter, 0)
}

// doLate is do; on /f/, late > 0 asks the checker to send its write that
// long after the request left (a stale writer), instead of while it holds
// the lock.
func (s *soak) doLate(inst int, path string, hold, cancelAfter, late time.Duration) {
	// X-Sent and the give-up deadline come from one reading of the clock:
	// the checker takes X-Sent + X-Cancel for the moment the client gave
	// up, which must not be later than the real one (a request built in
	// between, on a loaded machine, set X-Sent milliseconds after the
	// timeout started, and a lock rightly passed on by a client that gave
	// up read as an overlap).
	sent := time.UnixMicro(time.Now().UnixMicro())
	ctx := context.Background()
	if cancelAfter > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, sent.Add(cancelAfter))
		defer cancel()
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.caddies[inst].url()+path, nil)
	req.Header.Set("X-Hold", hold.String())
	req.Header.Set("X-Sent", strconv.FormatInt(sent.UnixMicro(), 10))
	if cancelAfter > 0 {
		req.Header.Set("X-Cancel", cancelAfter.String())
	}
	if late > 0 {
		req.Header.Set("X-Late", late.String())
	}
	from := s.check.now()
	resp, err := httpClient.Do(req)
	var ra string
	code := 0
	if err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		code, ra = resp.StatusCode, resp.Header.Get("Retry-After")
	}
	to := s.check.now()
	rt := route(path)
	if err == nil && rt == "fl" {
		s.flAnswer(from, to, resp.Header)
	}

	t := s.tally
	t.mu.Lock()
	defer t.mu.Unlock()
	t.requests[rt]++
	if err != nil {
		if cancelAfter > 0 && errors.Is(err, context.DeadlineExceeded) && ctx.Err() != nil {
			t.canceled++
			return
		}
		t.tErrs = append(t.tErrs, transportErr{inst: inst, from: from, to: to, err: err.Error()})
		return
	}
	t.statuses[code]++
	t.lat = append(t.lat, to-from)
	sample := fmt.Sprintf("%.3fs caddy%d GET %s → %d (Retry-After %q)", from.Seconds(), inst, path, code, ra)
	lockRoute := rt == "s" || rt == "r" || rt == "p" || rt == "rp" || rt == "stall" || rt == "f" || rt == "probe"
	switch {
	case code == 200 && rt != "bad":
	case code == 400 && rt == "bad":
	case code == 423 && lockRoute:
		if n, err := strconv.Atoi(ra); err != nil || n < 1 {
			t.unexpected("423 without Retry-After ≥ 1", sample)
		}
	case code == 429 && (rt == "rl" || rt == "fl"):
		if n, err := strconv.Atoi(ra); err != nil || n < 1 {
			t.unexpected("429 without Retry-After ≥ 1", sample)
		}
	case code == 409 && rt == "f": // the fence refused the holder's write: its lease was lost unnoticed
	case code == 503 && rt != "bad":
	default:
		t.unexpected(fmt.Sprintf("%d on /%s/", code, rt), sample)
	}
}

// work runs the route mix until stop.
func (s *soak) work(id int, stop time.Time) {
	rng := rand.New(rand.NewSource(s.seed*1000 + int64(id)))
	hold := func(lo, hi int) time.Duration { return time.Duration(lo+rng.Intn(hi-lo+1)) * time.Millisecond }
	for time.Now().Before(stop) {
		inst := rng.Intn(len(s.caddies))
		var path string
		var h time.Duration
		switch x := rng.Intn(100); {
		case x < 30:
			path, h = fmt.Sprintf("/s/hot%d", rng.Intn(2)), hold(1, 10)
		case x < 50:
			path, h = fmt.Sprintf("/r/hot%d", rng.Intn(2)), hold(1, 10)
		case x < 56:
			path, h = "/p/hot0", hold(5, 20)
		case x < 62 && *redlockPermits:
			path, h = "/rp/hot0", hold(5, 20)
		case x < 74:
			path, h = fmt.Sprintf("/s/cold%d", rng.Intn(200)), hold(1, 5)
		case x < 86:
			path, h = fmt.Sprintf("/r/cold%d", rng.Intn(200)), hold(1, 5)
		case x < 92:
			path, h = fmt.Sprintf("/stall/k%d", rng.Intn(2)), hold(1, 10)
		case x < 93:
			path = "/bad/x"
		default:
			path, h = "/p/hot1", hold(5, 20)
		}
		s.do(inst, path, h, 0)
	}
}

// rateWork hammers the rate-limited keys, well above their limit.
func (s *soak) rateWork(id int, stop time.Time) {
	rng := rand.New(rand.NewSource(s.seed*1000 + 500 + int64(id)))
	for time.Now().Before(stop) {
		s.do(rng.Intn(len(s.caddies)), fmt.Sprintf("/rl/k%d", rng.Intn(3)), 0, 0)
		time.Sleep(time.Duration(2+rng.Intn(10)) * time.Millisecond)
	}
}

// fenceWork keeps the fencing tier busy on two hot keys: a third of the
// requests write late, 20–100 ms after they left (most of them after the
// next holder's write: the fence must refuse them).
func (s *soak) fenceWork(id int, stop time.Time) {
	rng := rand.New(rand.NewSource(s.seed*1000 + 700 + int64(id)))
	for time.Now().Before(stop) {
		var late time.Duration
		if rng.Intn(3) == 0 {
			late = time.Duration(20+rng.Intn(81)) * time.Millisecond
		}
		s.doLate(rng.Intn(len(s.caddies)), fmt.Sprintf("/f/hot%d", rng.Intn(2)), time.Duration(1+rng.Intn(10))*time.Millisecond, 0, late)
	}
}

// runLoad runs every worker until stop and waits for them.
func (s *soak) runLoad(stop time.Time) {
	var wg sync.WaitGroup
	for i := 0; i < *workers; i++ {
		wg.Add(1)
		go func(i int) { defer wg.Done(); s.work(i, stop) }(i)
	}
	for i := 0; i < *rlWorkers; i++ {
		wg.Add(1)
		go func(i int) { defer wg.Done(); s.rateWork(i, stop) }(i)
	}
	for i := 0; i < *flWorkers; i++ {
		wg.Add(1)
		go func(i int) { defer wg.Done(); s.flWork(i, stop) }(i)
	}
	for i := 0; i < *fenceWorkers; i++ {
		wg.Add(1)
		go func(i int) { defer wg.Done(); s.fenceWork(i, stop) }(i)
	}
	for i := 0; i < *onceWorkers; i++ {
		wg.Add(1)
		go func(i int) { defer wg.Done(); s.onceWork(i, stop) }(i)
	}
	wg.Wait()
}

// cancelers: clients on hot keys that give up after 10–300 ms, most of
// them while waiting for the lock (the holders hold 40 ms).
func (s *soak) cancelers(d time.Duration) {
	stop := time.Now().Add(d)
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(time.Now().UnixNano() + int64(i)))
			paths := []string{"/s/hot0", "/r/hot0", "/p/hot0", "/f/hot0"}
			if *redlockPermits {
				paths = append(paths, "/rp/hot0")
			}
			for time.Now().Before(stop) {
				s.do(rng.Intn(len(s.caddies)), paths[rng.Intn(len(paths))], 40*time.Millisecond,
					time.Duration(10+rng.Intn(290))*time.Millisecond)
			}
		}(i)
	}
	wg.Wait()
}

// stall: two requests whose upstream holds for d, past the stall route's
// ttl (auto_extend keeps the lease; the checker must see no overlap).
func (s *soak) stall(d time.Duration) {
	var wg sync.WaitGroup
	for k := 0; k < 2; k++ {
		wg.Add(1)
		go func(k int) { defer wg.Done(); s.do(k, fmt.Sprintf("/stall/k%d", k), d, 0) }(k)
	}
	wg.Wait()
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(p*float64(len(s)-1))]
}

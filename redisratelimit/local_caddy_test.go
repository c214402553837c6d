package redisratelimit

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// TestWholeCaddyFailLocal: two instances (two sites with Redis clients of
// their own, on one redis-server) share `rate 20 2s` with fail_local and no
// `instances`: they learn N = 2 from their heartbeats. With Redis paused,
// the two together admit at most 20 in any 2 s and at least 16 per window
// (on average), each about half; after SIGCONT both decide by Redis again within
// seconds, and no interval of 2 s, across both edges of the outage, holds
// more than 20 admissions (the local ones were charged to Redis).
func TestWholeCaddyFailLocal(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	portA, portB, admin := freePort(t), freePort(t), freePort(t)
	site := func(port int, name, timeout string) string {
		return fmt.Sprintf(`:%d {
	redis_ratelimit {
		name %s
		key {http.request.header.X-User}
		rate 20 2s
		fail_local
		redis %s
		timeout %s
	}
	respond "{time.now.unix_ms}"
}
`, port, name, r.Addr, timeout)
	}
	testkit.RunCaddy(t, fmt.Sprintf("{\n\tadmin localhost:%d\n\tauto_https off\n}\n", admin)+site(portA, "fl_a", "300ms")+site(portB, "fl_b", "400ms"))
	var hs []*RedisRateLimit
	for _, e := range shared.RunningHandlers() {
		if h, ok := e.Handler.(*RedisRateLimit); ok {
			hs = append(hs, h)
		}
	}
	if len(hs) != 2 || hs[0].client == hs[1].client {
		t.Fatalf("want two handlers with clients of their own, got %d", len(hs))
	}
	if !waitFor(15*time.Second, func() bool { return hs[0].instances() == 2 && hs[1].instances() == 2 }) {
		t.Fatalf("instances seen: %d and %d, want 2 from the heartbeats", hs[0].instances(), hs[1].instances())
	}

	// One client per instance, a request every 20ms; each admission is
	// recorded at the server's time (the body).
	type admission struct {
		at   int64 // unix ms, the server's
		inst int
	}
	var mu sync.Mutex
	var admitted []admission
	statuses := map[int]int{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i, port := range []int{portA, portB} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 10 * time.Second}
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
				req.Header.Set("X-User", "fl")
				resp, err := c.Do(req)
				if err != nil {
					t.Errorf("instance %d: %v", i, err)
					return
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				mu.Lock()
				statuses[resp.StatusCode]++
				if resp.StatusCode == 200 {
					at, _ := strconv.ParseInt(string(body), 10, 64)
					admitted = append(admitted, admission{at, i})
				}
				mu.Unlock()
			}
		}()
	}
	stopLoad := func() {
		close(stop)
		wg.Wait()
	}
	time.Sleep(2 * time.Second) // a window through Redis
	r.Pause()
	paused := time.Now()
	if !waitFor(10*time.Second, func() bool { return hs[0].local.mode.Load() && hs[1].local.mode.Load() }) {
		r.Resume()
		stopLoad()
		t.Fatal("no local mode 10s after Redis was paused")
	}
	local := time.Now()
	time.Sleep(8 * time.Second) // four windows decided locally
	localEnd := time.Now()
	r.Resume()
	resumed := time.Now()
	ok := waitFor(10*time.Second, func() bool { return !hs[0].local.mode.Load() && !hs[1].local.mode.Load() })
	back := time.Since(resumed)
	time.Sleep(4 * time.Second) // two windows by Redis again
	stopLoad()
	if !ok {
		t.Fatal("still local 10s after Redis came back")
	}
	t.Logf("local mode %s after the pause; Redis decides again %s after SIGCONT; statuses %v", local.Sub(paused), back, statuses)
	if back > 5*time.Second {
		t.Errorf("decisions came back to Redis %s after SIGCONT, want within about a second (bound 5s)", back)
	}

	// No interval of 2 s holds more than 20 admissions: before, during and
	// after the outage. (The times are the servers' when they answered, a
	// little after Redis's or the local limiter's decision: 1.9 s absorbs
	// the spread of that delay on a loaded machine; a doubled limit at
	// either edge shows all the same.)
	slices.SortFunc(admitted, func(a, b admission) int { return int(a.at - b.at) })
	for i := range admitted {
		n := 0
		for j := i; j < len(admitted) && admitted[j].at < admitted[i].at+1900; j++ {
			n++
		}
		// Within about a second of SIGCONT both instances go back to Redis
		// and charge it, one a little before the other: an admission or
		// two more there (without the charge back it is 30 and more).
		limit := 20
		if from, at := resumed.UnixMilli()-1900, admitted[i].at; at > from && at < from+3000 {
			limit = 22
		}
		if n > limit {
			t.Errorf("%d admitted in the 1.9 s from %d ms (pause at %d, resume at %d), want at most %d", n, admitted[i].at, paused.UnixMilli(), resumed.UnixMilli(), limit)
		}
	}
	// Decided locally, at least 16 per window, each instance about half: on
	// average over the windows (an instance admits its share in bursts as
	// earlier admissions leave its window, and a window's edge may split
	// a burst; the upper bound above holds for every interval).
	var per [2]int
	from, to := local.UnixMilli(), localEnd.UnixMilli()
	for _, a := range admitted {
		if a.at >= from && a.at < to {
			per[a.inst]++
		}
	}
	windows := float64(to-from) / 2000
	total := float64(per[0] + per[1])
	t.Logf("decided locally in %.1f windows: %d + %d admitted", windows, per[0], per[1])
	if total/windows < 16 || total/windows > 20.5 {
		t.Errorf("decided locally: %.1f admitted per window on average (%d + %d in %.1f windows), want 16 to 20", total/windows, per[0], per[1], windows)
	}
	for i, n := range per {
		if f := float64(n) / total; f < 0.35 || f > 0.65 {
			t.Errorf("instance %d admitted %d of the %.0f local admissions, want about half", i, n, total)
		}
	}
}

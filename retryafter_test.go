package redisdlm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/redis/go-redis/v9"
)

// Tests of redis_lock's Retry-After, through a
// whole Caddy in-process against a real Redis. Each "instance" is a site of
// its own whose redis_lock has another `timeout` (as in redislock's
// wake_test.go): that gives it its own Redis client, local queues and id
// in the key's Redis wait list, as a second Caddy would have.

// jobUpstream runs a job per request: X-Job-Ms milliseconds long, or with
// X-Gate until the test opens the gate (at most a minute). It announces the
// request's X-Key on entered as the job starts.
type jobUpstream struct {
	*httptest.Server
	entered chan string
	gate    chan struct{}
	once    sync.Once
}

func newJobUpstream(t *testing.T) *jobUpstream {
	u := &jobUpstream{entered: make(chan string, 256), gate: make(chan struct{})}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.entered <- r.Header.Get("X-Key")
		if r.Header.Get("X-Gate") != "" {
			select {
			case <-u.gate:
			case <-r.Context().Done():
			case <-time.After(time.Minute):
			}
		} else if ms, _ := strconv.Atoi(r.Header.Get("X-Job-Ms")); ms > 0 {
			select {
			case <-time.After(time.Duration(ms) * time.Millisecond):
			case <-r.Context().Done():
			}
		}
		fmt.Fprint(w, "done")
	}))
	t.Cleanup(u.Server.Close)
	t.Cleanup(u.open)
	return u
}

// open lets every gated job finish; safe to call more than once.
func (u *jobUpstream) open() { u.once.Do(func() { close(u.gate) }) }

// awaitEntered waits until the job of key has started.
func (u *jobUpstream) awaitEntered(t *testing.T, key string) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case k := <-u.entered:
			if k == key {
				return
			}
		case <-deadline:
			t.Fatalf("the job of %s never started", key)
		}
	}
}

// runRetryAfterCaddy runs one Caddy with a site per lock options given
// (each a redis_lock keyed by X-Key in front of up) and returns their URLs
// and the admin endpoint's.
func runRetryAfterCaddy(t *testing.T, redisAddr string, up *jobUpstream, sites ...string) ([]string, string) {
	t.Helper()
	var cf strings.Builder
	admin := freePort(t)
	fmt.Fprintf(&cf, "{\n\tadmin localhost:%d\n\tauto_https off\n}\n", admin)
	urls := make([]string, len(sites))
	for i, opts := range sites {
		port := freePort(t)
		urls[i] = fmt.Sprintf("http://127.0.0.1:%d", port)
		fmt.Fprintf(&cf, ":%d {\n\tredis_lock {\n\t\tkey {http.request.header.X-Key}\n\t\tredis %s\n", port, redisAddr)
		for _, o := range strings.Split(opts, ";") {
			fmt.Fprintf(&cf, "\t\t%s\n", strings.TrimSpace(o))
		}
		fmt.Fprintf(&cf, "\t}\n\treverse_proxy %s\n}\n", strings.TrimPrefix(up.URL, "http://"))
	}
	testkit.RunCaddy(t, cf.String())
	return urls, fmt.Sprintf("http://localhost:%d", admin)
}

// job sends one request for key in the background: a job of ms
// milliseconds, or gated with ms < 0.
func job(url, key string, ms int) <-chan testkit.FetchResult {
	hdr := []string{"X-Key", key, "X-Job-Ms", strconv.Itoa(ms)}
	if ms < 0 {
		hdr = []string{"X-Key", key, "X-Gate", "1"}
	}
	return goFetchHdr(url, hdr...)
}

// busyRetryAfter sends a request for key that must find the lock busy, and
// returns its Retry-After.
func busyRetryAfter(t *testing.T, url, key string) int {
	t.Helper()
	r := <-job(url, key, 10)
	if r.Err != nil || r.Status != http.StatusLocked {
		t.Fatalf("request for busy %s: %d %v, want 423", key, r.Status, r.Err)
	}
	n, err := strconv.Atoi(r.Hdr.Get("Retry-After"))
	if err != nil || n < 1 {
		t.Fatalf("Retry-After %q: want whole seconds >= 1", r.Hdr.Get("Retry-After"))
	}
	return n
}

// awaitFree waits until no lease of the keys is left in Redis (the
// releases run after the answers), so nothing outlives the test.
func awaitFree(t *testing.T, rc *redis.Client, keys ...string) {
	t.Helper()
	for _, k := range keys {
		key := shared.StoredKey(redislock.DefaultLockPrefix, k)
		if !waitFor(20*time.Second, func() bool { n, err := rc.Exists(context.Background(), key).Result(); return err == nil && n == 0 }) {
			t.Errorf("lock %s still held after the test", k)
		}
	}
}

// learnHolds runs n jobs of ms milliseconds at once on url (keys of their
// own), so that its handler has seen that many holds end.
func learnHolds(t *testing.T, up *jobUpstream, url string, n, ms int) {
	t.Helper()
	var chs []<-chan testkit.FetchResult
	for i := 0; i < n; i++ {
		chs = append(chs, job(url, fmt.Sprintf("learn%d", i), ms))
	}
	for i, ch := range chs {
		if r := testkit.Await(t, ch, time.Duration(ms)*time.Millisecond+20*time.Second, "learning job"); r.Status != 200 {
			t.Fatalf("learning job %d: %d %v", i, r.Status, r.Err)
		}
	}
}

// TestRetryAfterHonouredGetsThrough: with 3 s jobs and their hold times
// learned, a client that is told Retry-After and comes back exactly then
// gets through on that first retry (at least 9 of 10 tries, coming at
// different points of the holder's job). Before, Retry-After was the median
// hold capped by the auto-extended lease (ttl 2s here), so the client was
// told 2 and came back while the 3 s job still ran: 0 of 10.
func TestRetryAfterHonouredGetsThrough(t *testing.T) {
	r := startRedis(t)
	up := newJobUpstream(t)
	urls, _ := runRetryAfterCaddy(t, r.Addr, up, "ttl 2s; wait 0s")
	url := urls[0]
	learnHolds(t, up, url, 3, 3000)

	const tries = 10
	type outcome struct {
		retryAfter, status int
		err                error
	}
	out := make(chan outcome, tries)
	for i := 0; i < tries; i++ {
		key := fmt.Sprintf("try%d", i)
		holder := job(url, key, 3000)
		up.awaitEntered(t, key)
		go func(i int) {
			// Come at a different point of the job each try.
			time.Sleep(time.Duration(i) * 200 * time.Millisecond)
			first := <-job(url, key, 3000)
			ra, err := strconv.Atoi(first.Hdr.Get("Retry-After"))
			if first.Err != nil || first.Status != http.StatusLocked || err != nil {
				out <- outcome{status: first.Status, err: fmt.Errorf("first request: %d %v, Retry-After %q", first.Status, first.Err, first.Hdr.Get("Retry-After"))}
				<-holder
				return
			}
			time.Sleep(time.Duration(ra) * time.Second) // honoured exactly
			retry := <-job(url, key, 10)
			out <- outcome{retryAfter: ra, status: retry.Status, err: retry.Err}
			<-holder
		}(i)
	}
	through := 0
	var seen []string
	for i := 0; i < tries; i++ {
		select {
		case o := <-out:
			if o.err == nil && o.status == http.StatusOK {
				through++
			}
			if o.retryAfter > 5 {
				t.Errorf("Retry-After %d for a 3 s job: far too late", o.retryAfter)
			}
			seen = append(seen, fmt.Sprintf("Retry-After %d → %d %v", o.retryAfter, o.status, o.err))
		case <-time.After(90 * time.Second):
			t.Fatalf("tries did not end; so far: %v", seen)
		}
	}
	if through < 9 {
		t.Fatalf("%d of %d clients that honoured Retry-After got through on the first retry, want at least 9: %v", through, tries, seen)
	}
	for i := 0; i < tries; i++ {
		awaitFree(t, r.Client(), fmt.Sprintf("try%d", i))
	}
}

// TestRetryAfterHolderOnAnotherInstance: the holder runs on instance B; A
// has learned 4 s holds and is asked 2.5 s into B's job. A's estimate starts
// from B's grant, as Redis timed it: about 1.5 s (+ the release allowance),
// not the full 4 s hold A would assume from its own knowledge (or the old
// median), nor from B's last extension (B's ttl is 2s, so its lease was
// extended three times by then); and a client coming back then gets
// through.
func TestRetryAfterHolderOnAnotherInstance(t *testing.T) {
	r := startRedis(t)
	up := newJobUpstream(t)
	urls, _ := runRetryAfterCaddy(t, r.Addr, up, "ttl 20s; wait 0s; timeout 500ms", "ttl 2s; wait 0s; timeout 510ms")
	a, b := urls[0], urls[1]
	learnHolds(t, up, a, 2, 4000)

	holder := job(b, "shared", 4000)
	up.awaitEntered(t, "shared")
	time.Sleep(2500 * time.Millisecond) // B's holder is 2.5 s into its job
	ra := busyRetryAfter(t, a, "shared")
	if ra > 3 {
		t.Errorf("2.5 s into B's 4 s job, A says Retry-After %d; want about 2 (from B's grant, not a whole hold from now)", ra)
	}
	time.Sleep(time.Duration(ra) * time.Second)
	if res := <-job(a, "shared", 10); res.Status != http.StatusOK {
		t.Errorf("retry after %d s: %d %v, want 200 (B's job is over)", ra, res.Status, res.Err)
	}
	testkit.Await(t, holder, 30*time.Second, "B's holder")
	awaitFree(t, r.Client(), "shared")
}

// TestRetryAfterCountsWaitersElsewhere: every other instance waiting in the
// key's Redis wait list raises A's estimate by about one p90 hold (3 s
// here). Before, only A's own queue counted: the figure stayed the same.
func TestRetryAfterCountsWaitersElsewhere(t *testing.T) {
	r := startRedis(t)
	up := newJobUpstream(t)
	urls, admin := runRetryAfterCaddy(t, r.Addr, up,
		"ttl 20s; wait 0s; timeout 500ms; name a",  // A: asks
		"ttl 20s; wait 0s; timeout 510ms; name b",  // B: holds
		"ttl 20s; wait 30s; timeout 520ms; name c", // C: waits
		"ttl 20s; wait 30s; timeout 530ms; name d") // D: waits
	a, b, c, d := urls[0], urls[1], urls[2], urls[3]
	learnHolds(t, up, a, 2, 3000)

	holder := job(b, "hot", -1)
	up.awaitEntered(t, "hot")
	rc := r.Client()
	// listed waits until the key's Redis wait list holds exactly the
	// instances named, as each instance's admin view of hot says. By
	// identity, not by count: A's own entry from its last ask leaves the
	// list only after its answer (in the background), so a count of 2
	// could be A and C before D has asked at all.
	listed := func(want ...string) {
		t.Helper()
		var last string
		if !waitFor(20*time.Second, func() bool {
			var got []string
			total := -1
			for _, name := range []string{"a", "b", "c", "d"} {
				var v struct {
					Servers []struct {
						InstancesWaiting int  `json:"instances_waiting"`
						ThisInstanceWait bool `json:"this_instance_waiting"`
					} `json:"servers"`
				}
				resp, body := get(t, admin+"/redisdlm/locks/"+name+"/hot")
				if resp == nil || resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &v) != nil || len(v.Servers) != 1 {
					last = fmt.Sprintf("%s: %s", name, body)
					return false
				}
				if v.Servers[0].ThisInstanceWait {
					got = append(got, name)
				}
				if total < 0 {
					total = v.Servers[0].InstancesWaiting
				}
			}
			last = fmt.Sprintf("%d instances, of them %v", total, got)
			return total == len(want) && slices.Equal(got, want)
		}) {
			t.Fatalf("wait list of hot: %s; want exactly %v", last, want)
		}
	}
	// When each answer says the lock is free: compared as moments, so the
	// time between the asks does not count.
	var ras []int
	free := func() time.Time {
		t.Helper()
		ra := busyRetryAfter(t, a, "hot")
		ras = append(ras, ra)
		return time.Now().Add(time.Duration(ra) * time.Second)
	}
	listed()
	free0 := free()
	listed()
	waiterC := job(c, "hot", 10)
	listed("c")
	free1 := free()
	waiterD := job(d, "hot", 10)
	listed("c", "d")
	free2 := free()
	if ras[1] <= ras[0] || ras[2] <= ras[1] {
		t.Errorf("Retry-After with 0, 1, 2 other instances waiting: %v; want it to grow with each", ras)
	}
	// Each step is one p90 (3 s), give or take the rounding to whole seconds.
	if d1, d2 := free1.Sub(free0), free2.Sub(free1); d1 < 1500*time.Millisecond || d1 > 4500*time.Millisecond ||
		d2 < 1500*time.Millisecond || d2 > 4500*time.Millisecond {
		t.Errorf("with 1, then 2 other instances waiting, the lock is said to be free %s, then %s later; want each step about the 3 s p90", d1, d2)
	}
	up.open()
	for _, w := range []<-chan testkit.FetchResult{holder, waiterC, waiterD} {
		if res := testkit.Await(t, w, 40*time.Second, "holder and waiters"); res.Status != http.StatusOK {
			t.Errorf("holder or waiter: %d %v, want 200", res.Status, res.Err)
		}
	}
	awaitFree(t, rc, "hot")
}

// TestRetryAfterNoHoldSeenIsLeaseLeft: before its handler has seen a hold
// end, Retry-After is the time left on the current lease — also when this
// instance holds the lock itself and has extended it past the ttl (3 s
// here, 4 s into the job: 2-3 s left), and for a holder on another
// instance. Before, a local holder's lease was known only as of its grant,
// so once the ttl had passed the answer was 1.
func TestRetryAfterNoHoldSeenIsLeaseLeft(t *testing.T) {
	r := startRedis(t)
	up := newJobUpstream(t)
	urls, _ := runRetryAfterCaddy(t, r.Addr, up, "ttl 3s; wait 0s; timeout 500ms", "ttl 30s; wait 0s; timeout 510ms")
	a, b := urls[0], urls[1]

	local := job(a, "mine", -1)
	up.awaitEntered(t, "mine")
	time.Sleep(4 * time.Second) // past the 3 s ttl: the lease was extended
	if ra := busyRetryAfter(t, a, "mine"); ra < 2 || ra > 3 {
		t.Errorf("own holder 4 s into its job, ttl 3s: Retry-After %d, want the lease's 2-3 s left", ra)
	}

	remote := job(b, "theirs", -1)
	up.awaitEntered(t, "theirs")
	if ra := busyRetryAfter(t, a, "theirs"); ra < 27 || ra > 30 {
		t.Errorf("holder on another instance, ttl 30s: Retry-After %d, want its lease's ~30 s left", ra)
	}
	up.open()
	for _, w := range []<-chan testkit.FetchResult{local, remote} {
		if res := testkit.Await(t, w, 30*time.Second, "holders"); res.Status != http.StatusOK {
			t.Errorf("holder: %d %v", res.Status, res.Err)
		}
	}
	awaitFree(t, r.Client(), "mine", "theirs")
}

// TestRetryAfterLocalHandOff: a lease handed on to a waiter of this
// instance (no Redis call) makes Redis's grant time the first holder's; the
// instance knows better, and says so. H1 and W1 queue on A behind a holder
// on B, so H1's grant reserves a token for W1 and hands the lease on; asked
// 1 s into W1's 3 s job (4 s after Redis's grant), A estimates from W1's
// start: about 2.5 s, not the lease (~20 s) of a holder past every hold
// seen; and a client coming back then gets through.
func TestRetryAfterLocalHandOff(t *testing.T) {
	r := startRedis(t)
	up := newJobUpstream(t)
	urls, admin := runRetryAfterCaddy(t, r.Addr, up,
		"ttl 20s; wait 30s; timeout 500ms; name a", // A, its waiters
		"ttl 20s; wait 0s; timeout 500ms",          // A too (one client, one queue), answering at once
		"ttl 20s; wait 0s; timeout 510ms")          // B
	a, asker, b := urls[0], urls[1], urls[2]
	learnHolds(t, up, asker, 2, 3000)

	h0 := job(b, "chain", -1)
	up.awaitEntered(t, "chain")
	h1 := goFetchHdr(a, "X-Key", "chain", "X-Job-Ms", "3000")
	w1 := goFetchHdr(a, "X-Key", "chain", "X-Job-Ms", "3000")
	rc := r.Client()
	waitq := lock.WaitqKey(shared.StoredKey(redislock.DefaultLockPrefix, "chain"))
	if !waitFor(20*time.Second, func() bool { n, _ := rc.ZCard(context.Background(), waitq).Result(); return n == 1 }) {
		t.Fatal("A never waited for chain in Redis")
	}
	var last string
	if !waitFor(20*time.Second, func() bool {
		var v struct {
			WaitersHere int `json:"waiters_here"`
		}
		resp, body := get(t, admin+"/redisdlm/locks/a/chain")
		last = body
		return resp != nil && json.Unmarshal([]byte(body), &v) == nil && v.WaitersHere == 2
	}) {
		t.Fatalf("H1 and W1 never both queued on A: %s", last)
	}
	up.open()
	up.awaitEntered(t, "chain") // H1
	up.awaitEntered(t, "chain") // W1, by hand-off
	time.Sleep(time.Second)
	ra := busyRetryAfter(t, asker, "chain")
	if ra > 4 {
		t.Errorf("1 s into W1's 3 s job (handed on here): Retry-After %d, want about 3", ra)
	}
	time.Sleep(time.Duration(ra) * time.Second)
	if res := <-job(asker, "chain", 10); res.Status != http.StatusOK {
		t.Errorf("retry after %d s: %d %v, want 200 (W1's job is over)", ra, res.Status, res.Err)
	}
	for _, w := range []<-chan testkit.FetchResult{h0, h1, w1} {
		if res := testkit.Await(t, w, 30*time.Second, "holders"); res.Status != http.StatusOK {
			t.Errorf("holder: %d %v", res.Status, res.Err)
		}
	}
	awaitFree(t, rc, "chain")
}

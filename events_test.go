package redisdlm

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() { caddy.RegisterModule(eventSink{}) }

// eventSink is an events.handlers module for tests: it records every event
// it receives.
type eventSink struct{}

var sunk struct {
	mu     sync.Mutex
	events []caddy.Event
}

func (eventSink) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.redisdlm_test_sink", New: func() caddy.Module { return new(eventSink) }}
}

func (*eventSink) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { d.Next(); return nil }

func (*eventSink) Handle(_ context.Context, e caddy.Event) error {
	sunk.mu.Lock()
	sunk.events = append(sunk.events, e)
	sunk.mu.Unlock()
	return nil
}

// sinkMark is the number of events received so far: a test counts the
// events after its mark (the sink outlives a test, also with -count).
func sinkMark() int {
	sunk.mu.Lock()
	defer sunk.mu.Unlock()
	return len(sunk.events)
}

// eventsNamed returns the events received since mark with this name.
func eventsNamed(mark int, name string) []caddy.Event {
	sunk.mu.Lock()
	defer sunk.mu.Unlock()
	var out []caddy.Event
	for _, e := range sunk.events[mark:] {
		if e.Name() == name {
			out = append(out, e)
		}
	}
	return out
}

// exceededWith counts the rate_limit_exceeded events since mark whose data
// has field set to value.
func exceededWith(mark int, field, value string) int {
	n := 0
	for _, e := range eventsNamed(mark, shared.EventRateLimitExceeded) {
		if e.Data[field] == value {
			n++
		}
	}
	return n
}

// TestWholeCaddyEvents: through a real Caddy
// whose config subscribes an events.handlers module: a rejection emits
// rate_limit_exceeded with handler, key and reason, once per key while the
// deny cache answers; a force release through the admin API emits
// redis_lock_forced from the lock handler itself, and the holder's next
// extension finds the lease gone and emits redis_lock_lost.
func TestWholeCaddyEvents(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	// The job runs until its lease is found lost (bounded), so an
	// extension surely comes after the force release.
	mark := sinkMark()
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		waitFor(20*time.Second, func() bool { return len(eventsNamed(mark, shared.EventLockLost)) > 0 })
		w.WriteHeader(200)
	}))
	defer slow.Close()
	port, admin := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	auto_https off
	events {
		on rate_limit_exceeded redisdlm_test_sink
		on redis_lock_forced redisdlm_test_sink
		on redis_lock_lost redisdlm_test_sink
	}
}
:%d {
	route /limited {
		redis_ratelimit {
			name logins
			key {http.request.header.X-User}
			rate 1 1m
			redis %s
		}
		respond "ok"
	}
	route /held {
		redis_ratelimit {
			name held
			key {http.request.header.X-User}
			rate 1 1m
			wait 1s
			redis %s
		}
		respond "ok"
	}
	route /job/* {
		redis_lock {
			name jobs
			ttl 900ms
			on_lost continue
			redis %s
		}
		reverse_proxy %s
	}
}
`, admin, port, r.Addr, r.Addr, r.Addr, strings.TrimPrefix(slow.URL, "http://")))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)

	for i, want := range []int{200, 429, 429, 429} {
		if resp, _ := get(t, base+"/limited", "X-User", "mallory"); resp == nil || resp.StatusCode != want {
			t.Fatalf("request %d: %v, want %d", i, resp, want)
		}
	}
	ex := eventsNamed(mark, shared.EventRateLimitExceeded)
	if len(ex) != 1 {
		t.Fatalf("%d rate_limit_exceeded events for three rejections of one key (the deny cache answers the later two), want 1", len(ex))
	}
	if d := ex[0].Data; d["handler"] != "logins" || d["key"] != "mallory" || !strings.Contains(fmt.Sprint(d["reason"]), "r0") {
		t.Errorf("rate_limit_exceeded data %v", d)
	}
	if o := ex[0].Origin(); o == nil || o.CaddyModule().ID != "http.handlers.redis_ratelimit" {
		t.Errorf("rate_limit_exceeded origin %v, want the redis_ratelimit handler", o)
	}
	// With wait the deny cache keeps no rejection: still one event per key
	// per period.
	for i, want := range []int{200, 429, 429, 429} {
		if resp, _ := get(t, base+"/held", "X-User", "trudy"); resp == nil || resp.StatusCode != want {
			t.Fatalf("held route, request %d: %v, want %d", i, resp, want)
		}
	}
	if held := exceededWith(mark, "handler", "held"); held != 1 {
		t.Errorf("%d rate_limit_exceeded events for three rejections of one key under wait, want 1", held)
	}
	// Concurrent rejections reach Redis before the deny cache holds one:
	// still one event for the key.
	var flood sync.WaitGroup
	for range 20 {
		flood.Add(1)
		go func() { defer flood.Done(); get(t, base+"/limited", "X-User", "eve") }()
	}
	flood.Wait()
	if eve := exceededWith(mark, "key", "eve"); eve != 1 {
		t.Errorf("%d rate_limit_exceeded events for 19 concurrent rejections of one key, want 1", eve)
	}

	holder := testkit.GoFetch(context.Background(), base+"/job/42")
	if !waitFor(10*time.Second, func() bool { return heldBy(r, shared.StoredKey(redislock.DefaultLockPrefix, "/job/42")) == 1 }) {
		t.Fatal("the job never held its lock")
	}
	resp, err := http.Post(fmt.Sprintf("http://localhost:%d/redisdlm/locks/jobs/%%2Fjob%%2F42/release", admin), "", nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("force release: %v %v", resp, err)
	}
	resp.Body.Close()
	testkit.Await(t, holder, 20*time.Second, "the job")
	forced, lost := eventsNamed(mark, shared.EventLockForced), eventsNamed(mark, shared.EventLockLost)
	if len(forced) != 1 || forced[0].Data["handler"] != "jobs" || forced[0].Data["key"] != "/job/42" {
		t.Fatalf("redis_lock_forced events %v, want one for jobs /job/42", forced)
	}
	if o := forced[0].Origin(); o == nil || o.CaddyModule().ID != "http.handlers.redis_lock" {
		t.Errorf("redis_lock_forced origin %v, want the redis_lock handler (not the admin module)", o)
	}
	if len(lost) != 1 || lost[0].Data["handler"] != "jobs" || lost[0].Data["key"] != "/job/42" || lost[0].Data["reason"] == "" {
		t.Fatalf("redis_lock_lost events %v, want one for jobs /job/42 with a reason", lost)
	}
}

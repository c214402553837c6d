package redisdlm

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
)

// heldPaymentUpstream places a payment per call, numbered; the first call is
// held until the test releases it (the upstream answers while the
// holder's Caddy is paused).
type heldPaymentUpstream struct {
	calls    atomic.Int64
	arrived  chan struct{}
	release  chan struct{}
	releaseO sync.Once
}

func (u *heldPaymentUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := u.calls.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	if n == 1 {
		u.arrived <- struct{}{}
		select {
		case <-u.release:
		case <-time.After(60 * time.Second):
		}
	}
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, "payment #%d", n)
}

func (u *heldPaymentUpstream) let() { u.releaseO.Do(func() { close(u.release) }) }

// TestWholeCaddyNeverTwicePausedHolder: a client's POST under replay goes
// through Caddy A, which is paused (SIGSTOP) past its lease while the
// upstream works; the client's retry goes through Caddy B meanwhile. The
// upstream runs the payment once: B answers the retry 409 (the run's
// outcome is in doubt), never a second run. When A resumes, the holder's
// answer, which comes after its lease ended, goes out only as the answer
// stored for the key: with on_lost continue it is (A's client gets
// payment #1, and every later retry is replayed it); with on_lost cancel
// the extension that finds the lease lost may cancel the run first (A's
// client gets 503, retries get 409), or the answer is stored as with
// continue. Either way the upstream sees one call.
func TestWholeCaddyNeverTwicePausedHolder(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	t.Parallel()
	for _, onLost := range []string{"continue", "cancel"} {
		t.Run(onLost, func(t *testing.T) {
			t.Parallel()
			r := startRedis(t)
			up := &heldPaymentUpstream{arrived: make(chan struct{}, 1), release: make(chan struct{})}
			us := httptest.NewServer(up)
			t.Cleanup(us.Close)
			t.Cleanup(up.let)
			caddyfile := func(port int) func(string) string {
				return func(dir string) string {
					return fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	storage file_system %s
	log {
		level ERROR
	}
}
http://127.0.0.1:%d {
	@post method POST
	redis_lock @post {
		key {http.request.header.X-User}:{http.request.header.Idempotency-Key}
		replay 60s
		ttl 2s
		wait 20s
		on_lost %s
		redis %s
	}
	reverse_proxy %s
}
`, dir, port, onLost, r.Addr, us.Listener.Addr())
				}
			}
			portA, portB := freePort(t), freePort(t)
			a := startCaddyProcess(t, "A", portA, caddyfile(portA))
			b := startCaddyProcess(t, "B", portB, caddyfile(portB))
			pay := func(base string) <-chan [3]string {
				ch := make(chan [3]string, 1)
				go func() {
					st, hdr, body, err := testkit.Post(base+"/pay", `{"amount":100}`, "X-User", "carol", "Idempotency-Key", "pay-7")
					if err != nil {
						body = err.Error()
					}
					ch <- [3]string{fmt.Sprint(st), body, hdr.Get(redislock.HeaderIdempotentReplayed)}
				}()
				return ch
			}
			first := pay(a.url())
			select {
			case <-up.arrived:
			case <-time.After(60 * time.Second):
				t.Fatal("the first POST never reached the upstream")
			}
			a.signal(t, syscall.SIGSTOP)
			resumed := false
			defer func() {
				if !resumed {
					a.signal(t, syscall.SIGCONT)
				}
			}()
			// B's retry waits while A's lease is live (2s at most: A cannot
			// extend), then finds the run in doubt.
			retry := <-pay(b.url())
			if retry[0] != "409" || !strings.Contains(retry[1], "outcome is unknown") {
				t.Fatalf("the retry through B while A is paused: %s %q; want 409 with a reason", retry[0], retry[1])
			}
			if c := up.calls.Load(); c != 1 {
				t.Fatalf("the upstream ran %d times while A was paused, want once", c)
			}
			time.Sleep(time.Second) // A's lease surely over by its own clock too
			up.let()                // the upstream answers A, still paused
			a.signal(t, syscall.SIGCONT)
			resumed = true
			var got [3]string
			select {
			case got = <-first:
			case <-time.After(60 * time.Second):
				t.Fatal("A never answered its client after the pause")
			}
			later := <-pay(b.url())
			switch {
			case got[0] == "201" && got[1] == "payment #1":
				if later[0] != "201" || later[1] != "payment #1" || later[2] != "true" {
					t.Errorf("a retry after A answered payment #1: %v; want payment #1 replayed", later)
				}
			case got[0] == "503" && onLost == "cancel":
				if later[0] != "409" {
					t.Errorf("a retry after A's run was cancelled in doubt: %v; want 409", later)
				}
			default:
				t.Errorf("A's client after the pause (on_lost %s): %v; want 201 payment #1%s", onLost, got,
					map[bool]string{true: " or 503"}[onLost == "cancel"])
			}
			if c := up.calls.Load(); c != 1 {
				t.Fatalf("the upstream ran %d times, want once", c)
			}
		})
	}
}

// TestWholeCaddyNeverTwiceUpstreamUnreachable: a run that reverse_proxy
// could not deliver (nothing listens on the upstream's port) never
// happened, so it does not leave the key in doubt: the retry runs, and
// once the upstream is there its answer is stored and replayed.
func TestWholeCaddyNeverTwiceUpstreamUnreachable(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	upPort, port := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin off
	auto_https off
}
:%d {
	redis_lock {
		key {http.request.header.Idempotency-Key}
		replay 1m
		redis %s
	}
	reverse_proxy 127.0.0.1:%d
}
`, port, r.Addr, upPort))
	base := fmt.Sprintf("http://127.0.0.1:%d/pay", port)
	for i := 0; i < 2; i++ {
		if st, _, body, err := testkit.Post(base, "x", "Idempotency-Key", "k1"); err != nil || st != http.StatusBadGateway {
			t.Fatalf("POST %d with no upstream: %d %q %v; want 502 (and no run in doubt)", i, st, body, err)
		}
	}
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", upPort))
	if err != nil {
		t.Fatal(err)
	}
	up := new(testkit.OrderUpstream)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _ = up.ServeHTTP(w, r) })}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	st, _, body, err := testkit.Post(base, "x", "Idempotency-Key", "k1")
	if err != nil || st != http.StatusCreated || body != "order #1" {
		t.Fatalf("POST once the upstream listens: %d %q %v; want order #1", st, body, err)
	}
	st, hdr, body, err := testkit.Post(base, "x", "Idempotency-Key", "k1")
	if err != nil || st != http.StatusCreated || body != "order #1" || hdr.Get(redislock.HeaderIdempotentReplayed) != "true" {
		t.Fatalf("the retry: %d %q replayed=%q %v; want order #1 replayed", st, body, hdr.Get(redislock.HeaderIdempotentReplayed), err)
	}
}

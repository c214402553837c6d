package redisdlm

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddy-dlm/redisdlm/redislock"
)

// TestWholeCaddyReplay: Caddy with a replayed idempotent POST in front of
// reverse_proxy: 10 concurrent duplicates cost one upstream call, all get
// its answer, and the replay counter shows at /metrics.
func TestWholeCaddyReplay(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	var calls atomic.Int64
	upSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		n := calls.Add(1)
		time.Sleep(200 * time.Millisecond)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", n)
	}))
	defer upSrv.Close()
	port, admin := freePort(t), freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin localhost:%d
	metrics
	auto_https off
}
:%d {
	@post method POST
	redis_lock @post {
		key {http.request.header.X-User}:{http.request.header.Idempotency-Key}
		replay 1m
		redis %s
	}
	reverse_proxy %s
}
`, admin, port, r.Addr, strings.TrimPrefix(upSrv.URL, "http://")))
	url := fmt.Sprintf("http://127.0.0.1:%d/orders", port)
	var wg sync.WaitGroup
	var bad atomic.Int32
	for i := 0; i < 10; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, _, body, err := testkit.Post(url, "sku=1", "X-User", "alice", "Idempotency-Key", "abc")
			if err != nil || st != 201 || body != "order 1" {
				bad.Add(1)
			}
		}()
	}
	wg.Wait()
	if calls.Load() != 1 || bad.Load() != 0 {
		t.Fatalf("10 duplicates through Caddy: %d upstream calls, %d other answers; want 1 call, one answer", calls.Load(), bad.Load())
	}
	resp, err := http.Get(fmt.Sprintf("http://localhost:%d/metrics", admin))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `result="replayed"} `) {
		t.Error("metrics lack caddy_redis_lock_replays_total{result=\"replayed\"}")
	}
}

// TestReplayAnswerOutlivesClient: a client posts a
// payment through Caddy (redis_lock with replay in front of
// reverse_proxy) and gives up after 0.5 s while the upstream takes 1.5 s;
// the same POST is then sent twice, once to each of two instances (sites
// with their own Redis clients, so their own pools, queues and instance
// ids). The upstream sees one call and never two at once; both retries
// wait for the first run and get its answer, replayed. Before the fix the
// proxy aborted when the client left, the lock was released, nothing was
// stored, and a retry ran the payment a second time while the first was
// still running.
func TestReplayAnswerOutlivesClient(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	up := &testkit.PaymentUpstream{Hold: 1500 * time.Millisecond}
	upSrv := httptest.NewServer(up)
	defer upSrv.Close()
	portA, portB, admin := freePort(t), freePort(t), freePort(t)
	site := func(port int, timeout string) string {
		return fmt.Sprintf(`:%d {
	@post method POST
	redis_lock @post {
		key {http.request.header.X-User}:{http.request.header.Idempotency-Key}
		replay 24h
		wait 20s
		timeout %s
		redis %s
	}
	reverse_proxy %s
}
`, port, timeout, r.Addr, strings.TrimPrefix(upSrv.URL, "http://"))
	}
	testkit.RunCaddy(t, fmt.Sprintf("{\n\tadmin localhost:%d\n\tauto_https off\n}\n", admin)+site(portA, "2s")+site(portB, "3s"))
	urlA := fmt.Sprintf("http://127.0.0.1:%d/pay", portA)
	urlB := fmt.Sprintf("http://127.0.0.1:%d/pay", portB)

	impatient := &http.Client{Timeout: 500 * time.Millisecond}
	req, _ := http.NewRequest("POST", urlA, strings.NewReader(`{"amount":100}`))
	req.Header.Set("X-User", "alice")
	req.Header.Set("Idempotency-Key", "pay-1")
	if resp, err := impatient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("the impatient client got %d before the 1.5 s upstream answered", resp.StatusCode)
	}

	type answer struct {
		status   int
		body     string
		replayed string
		err      error
	}
	answers := make([]answer, 2)
	var wg sync.WaitGroup
	for i, url := range []string{urlA, urlB} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, hdr, body, err := testkit.Post(url, `{"amount":100}`, "X-User", "alice", "Idempotency-Key", "pay-1")
			answers[i] = answer{st, body, hdr.Get(redislock.HeaderIdempotentReplayed), err}
		}()
	}
	wg.Wait()
	for i, a := range answers {
		if a.err != nil || a.status != 201 || a.body != "payment #1" || a.replayed != "true" {
			t.Errorf("retry %d: %d %q replayed=%q %v; want the first payment's answer, replayed", i, a.status, a.body, a.replayed, a.err)
		}
	}
	if c, o := up.Calls.Load(), up.Overlap(); c != 1 || o != 1 {
		t.Fatalf("the upstream saw %d calls, %d at once; want 1 call", c, o)
	}
}

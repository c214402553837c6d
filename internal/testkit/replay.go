package testkit

// What the tests of replay (redis_lock's idempotent answers) share, in
// redislock and in the root: upstreams that count their calls, and
// requests with a body.

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// OrderUpstream places an "order" per call: it counts calls and answers
// with the call's number in the body and a header, plus a cookie. The
// status comes from ?status=, the body size from ?size=, a delay from
// ?sleep=.
type OrderUpstream struct{ Calls atomic.Int64 }

func (u *OrderUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	n := u.Calls.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	if d, err := time.ParseDuration(r.URL.Query().Get("sleep")); err == nil {
		time.Sleep(d)
	}
	status := http.StatusCreated
	if s, err := strconv.Atoi(r.URL.Query().Get("status")); err == nil {
		status = s
	}
	body := fmt.Sprintf("order #%d", n)
	if size, err := strconv.Atoi(r.URL.Query().Get("size")); err == nil {
		body = strings.Repeat("x", size)
	}
	w.Header().Set("X-Order", strconv.FormatInt(n, 10))
	w.Header().Set("Set-Cookie", "session=s"+strconv.FormatInt(n, 10))
	w.Header().Set("Connection", "X-Hop")
	w.Header().Set("X-Hop", "per-connection")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, body)
	return nil
}

// Post sends one POST with headers (name, value pairs) and returns status,
// headers and body; it never touches testing.T (safe in goroutines).
func Post(url, body string, hdr ...string) (int, http.Header, string, error) {
	return SendBody("POST", url, body, hdr...)
}

// SendBody sends one request with a body and headers (name, value pairs,
// added: a name may repeat).
func SendBody(method, url, body string, hdr ...string) (int, http.Header, string, error) {
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return 0, nil, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b), nil
}

// PaymentUpstream is a payment backend: each call takes Hold, finishes
// even when the proxy in front of it goes away, and counts calls and how
// many ran at once.
type PaymentUpstream struct {
	Hold          time.Duration
	Calls, inside atomic.Int64
	mu            sync.Mutex
	most          int64
}

func (u *PaymentUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := u.Calls.Add(1)
	in := u.inside.Add(1)
	u.mu.Lock()
	u.most = max(u.most, in)
	u.mu.Unlock()
	time.Sleep(u.Hold) // not r.Context(): the payment goes through anyway
	u.inside.Add(-1)
	w.Header().Set("X-Payment", fmt.Sprint(n))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, "payment #%d", n)
}

// Overlap is the most calls that ran at once.
func (u *PaymentUpstream) Overlap() int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.most
}

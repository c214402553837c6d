package redislock

import (
	"bufio"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// hijackableRecorder stands for Caddy's connection writer: it can hijack
// and take deadlines.
type hijackableRecorder struct{ *httptest.ResponseRecorder }

func (hijackableRecorder) Hijack() (net.Conn, *bufio.ReadWriter, error) { return nil, nil, nil }
func (hijackableRecorder) SetReadDeadline(time.Time) error              { return nil }
func (hijackableRecorder) SetWriteDeadline(time.Time) error             { return nil }

// The writer the lock hands to the rest of the route reaches the
// connection's features through http.ResponseController, as
// reverse_proxy's upgrades (WebSocket: Hijack) and deadlines need.
func TestLockedWriterReachesConnection(t *testing.T) {
	rw := &startedWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: hijackableRecorder{httptest.NewRecorder()}}}
	rc := http.NewResponseController(rw)
	if _, _, err := rc.Hijack(); err != nil {
		t.Errorf("Hijack through the locked route's writer: %v", err)
	}
	if err := rc.SetReadDeadline(time.Now()); err != nil {
		t.Errorf("SetReadDeadline through the locked route's writer: %v", err)
	}
	if err := rc.SetWriteDeadline(time.Now()); err != nil {
		t.Errorf("SetWriteDeadline through the locked route's writer: %v", err)
	}
	if err := rc.Flush(); err != nil {
		t.Errorf("Flush through the locked route's writer: %v", err)
	}
}

// TestHeaderSnapshot: the header as handlers before the lock left it comes
// back exactly, whatever the route did to it meanwhile (set, added,
// deleted, or changed a value in place), inline (one or two fields of one
// value) or cloned (more fields, or a field of several values).
func TestHeaderSnapshot(t *testing.T) {
	cases := map[string]http.Header{
		"empty":             {},
		"Server only":       {"Server": {"Caddy"}},
		"two fields":        {"Server": {"Caddy"}, "X-Request-Id": {"abc"}},
		"three fields":      {"Server": {"Caddy"}, "X-Request-Id": {"abc"}, "Vary": {"Origin"}},
		"several values":    {"Server": {"Caddy"}, "Vary": {"Origin", "Accept"}},
		"a field, no value": {"X-Empty": {}},
	}
	for name, before := range cases {
		t.Run(name, func(t *testing.T) {
			want := before.Clone()
			w := &startedWriter{}
			w.ResponseWriter = httptest.NewRecorder()
			h := w.Header()
			for k, v := range before {
				h[k] = v
			}
			w.before.save(h)
			// The route, without the lock:
			for k := range h {
				if len(h[k]) > 0 {
					h[k][0] = "changed in place"
				}
			}
			h.Set("Set-Cookie", "session=1")
			h.Add("Server", "another")
			h.Del("X-Request-Id")
			w.restoreHeader()
			if got := w.Header(); !headersEqual(got, want) {
				t.Fatalf("restored %v, want %v", got, want)
			}
			if got := w.before.header(); !headersEqual(got, want) {
				t.Fatalf("the snapshot as a header: %v, want %v", got, want)
			}
		})
	}
}

func headersEqual(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		w, ok := b[k]
		if !ok || len(v) != len(w) {
			return false
		}
		for i := range v {
			if v[i] != w[i] {
				return false
			}
		}
	}
	return true
}

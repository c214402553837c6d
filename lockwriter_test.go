package redisdlm

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

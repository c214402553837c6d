package redisdlm

// Execute once (`replay`): the holder's response is captured while it
// streams to its own client, stored in Redis by the script that releases
// the lock, and given to every duplicate — waiting or arriving later, in
// any instance — instead of running the route again.

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// HeaderIdempotentReplayed marks an answer replayed from a stored response.
const HeaderIdempotentReplayed = "Idempotent-Replayed"

// DefaultReplayMax is the largest response body (and, with the default
// fingerprint, request body) that replay handles: 1 MiB.
const DefaultReplayMax = 1 << 20

// MaxReplayMax is the largest replay_max accepted: 256 MiB. A stored
// answer is one Redis string (at most 512 MB) that holds the headers as
// well as the body, and the body is kept in Caddy's memory until the
// release stores it.
const MaxReplayMax = 256 << 20

// replayFormat starts every stored answer (a version, for later changes).
const replayFormat = "rdlm1"

// hopByHop are the headers that describe one connection, not the response;
// they are never stored (nor those that Connection names).
var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// errBodyTooLarge: with the default fingerprint a request body over
// replay_max cannot be fingerprinted; it is answered 413.
var errBodyTooLarge = errors.New("redisdlm: request body larger than replay_max")

// fingerprint returns the identity a replay must match beyond the key:
// by default method, URI and the SHA-256 of the body (the body is read, up
// to replay_max, and passed on unchanged), or the rendered templates, or
// "" with `fingerprint off`.
func (h *RedisLock) fingerprint(r *http.Request, repl *caddy.Replacer) (string, error) {
	if h.fingerprintOff() {
		return "", nil
	}
	if len(h.Fingerprint) > 0 {
		parts := make([]string, len(h.Fingerprint))
		for i, t := range h.Fingerprint {
			parts[i] = repl.ReplaceAll(t, "")
		}
		return digest(strings.Join(parts, "\x00")), nil
	}
	sum := sha256.New()
	if r.Body != nil && r.Body != http.NoBody {
		body, err := io.ReadAll(io.LimitReader(r.Body, h.ReplayMax+1))
		if err != nil {
			return "", fmt.Errorf("reading the request body: %w", err)
		}
		if int64(len(body)) > h.ReplayMax {
			return "", errBodyTooLarge
		}
		_ = r.Body.Close()
		r.Body = io.NopCloser(bytes.NewReader(body))
		sum.Write(body)
	}
	return digest(r.Method + "\x00" + r.RequestURI + "\x00" + hex.EncodeToString(sum.Sum(nil))), nil
}

func (h *RedisLock) fingerprintOff() bool {
	return len(h.Fingerprint) == 1 && h.Fingerprint[0] == "off"
}

func digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// storedAnswer is a response as kept in Redis.
type storedAnswer struct {
	Fingerprint string      `json:"f"`
	Status      int         `json:"s"`
	Header      http.Header `json:"h"`
	body        []byte
}

// encode lays an answer out as "rdlm1\n<json head>\n<body>".
func (a *storedAnswer) encode() string {
	head, _ := json.Marshal(a)
	var b strings.Builder
	b.Grow(len(replayFormat) + len(head) + len(a.body) + 2)
	b.WriteString(replayFormat)
	b.WriteByte('\n')
	b.Write(head)
	b.WriteByte('\n')
	b.Write(a.body)
	return b.String()
}

func decodeAnswer(s string) (*storedAnswer, error) {
	format, rest, ok := strings.Cut(s, "\n")
	if !ok || format != replayFormat {
		return nil, errors.New("redisdlm: stored answer in an unknown format")
	}
	head, body, ok := strings.Cut(rest, "\n")
	if !ok {
		return nil, errors.New("redisdlm: stored answer cut short")
	}
	a := new(storedAnswer)
	if err := json.Unmarshal([]byte(head), a); err != nil {
		return nil, fmt.Errorf("redisdlm: stored answer: %w", err)
	}
	a.body = []byte(body)
	return a, nil
}

// serveReplay answers r with a stored answer, or 422 when r's fingerprint
// differs from the stored request's.
func (h *RedisLock) serveReplay(w http.ResponseWriter, r *http.Request, fp, display, stored string) error {
	a, err := decodeAnswer(stored)
	if err != nil {
		return caddyhttp.Error(http.StatusInternalServerError, err)
	}
	if a.Fingerprint != fp {
		replayMismatch.Inc()
		if c := h.logger.Check(zapcore.DebugLevel, "replay: request differs from the stored one; answering 422"); c != nil {
			c.Write(zap.String("key", display))
		}
		return caddyhttp.Error(http.StatusUnprocessableEntity,
			errors.New("redisdlm: this key was used with another request (method, URI or body differ)"))
	}
	replayReplayed.Inc()
	if c := h.logger.Check(zapcore.DebugLevel, "replaying stored response"); c != nil {
		c.Write(zap.String("key", display), zap.Int("status", a.Status))
	}
	// The headers the route set (what handlers before the lock set for
	// this request, such as a request id, stay this request's own).
	hdr := w.Header()
	for k, v := range a.Header {
		hdr[k] = v
	}
	hdr.Set(HeaderIdempotentReplayed, "true")
	if r.Method != http.MethodHead && bodyAllowed(a.Status) {
		hdr.Set("Content-Length", strconv.Itoa(len(a.body)))
	} // else the stored Content-Length (of a HEAD answer, say) stays
	w.WriteHeader(a.Status)
	_, _ = w.Write(a.body)
	return nil
}

// bodyAllowed reports whether a response of this status has a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// recorder passes a response on to the client unchanged and keeps a copy
// of it, up to max bytes of body, for replay.
type recorder struct {
	*caddyhttp.ResponseWriterWrapper
	max      int64
	before   http.Header // the header as handlers before the lock left it
	status   int
	header   http.Header // what the route set, copied when the header is written
	body     bytes.Buffer
	overflow bool  // the body outgrew max
	writeErr error // the client went away mid-response
}

// newRecorder records what the route writes to w; before is w's header as
// handlers before the lock left it.
func newRecorder(w http.ResponseWriter, max int64, before http.Header) *recorder {
	return &recorder{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, max: max, before: before}
}

func (rec *recorder) WriteHeader(code int) {
	if rec.status == 0 && (code >= 200 || code == http.StatusSwitchingProtocols) {
		rec.status = code
		// Only the fields the route set or changed: those set before the
		// lock (a request id, CORS) belong to each request.
		rec.header = http.Header{}
		for k, v := range rec.Header() {
			if old, ok := rec.before[k]; !ok || !slices.Equal(old, v) {
				rec.header[k] = slices.Clone(v)
			}
		}
	}
	rec.ResponseWriterWrapper.WriteHeader(code)
}

func (rec *recorder) Write(b []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if !rec.overflow {
		if int64(rec.body.Len()+len(b)) > rec.max {
			rec.overflow = true
			rec.body = bytes.Buffer{}
		} else {
			rec.body.Write(b)
		}
	}
	n, err := rec.ResponseWriterWrapper.Write(b)
	if err != nil && rec.writeErr == nil {
		rec.writeErr = err
	}
	return n, err
}

// ReadFrom (io.Copy, file_server) goes through Write, so the body is kept
// too (the wrapper's own ReadFrom would pass it by).
func (rec *recorder) ReadFrom(r io.Reader) (int64, error) {
	return io.Copy(struct{ io.Writer }{rec}, r)
}

// Flush passes a flush on. A flushed answer is still stored when it ends
// (reverse_proxy flushes every answer without a Content-Length); a stream
// that does not end within replay_max is not.
func (rec *recorder) Flush() {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK) // a flush sends the header: record it now
	}
	_ = http.NewResponseController(rec.ResponseWriterWrapper).Flush()
}

// streamed reports an answer that is a stream by nature (server-sent
// events, a protocol switch): never replayed.
func (rec *recorder) streamed() bool {
	ct, _, _ := strings.Cut(rec.header.Get("Content-Type"), ";")
	return rec.status == http.StatusSwitchingProtocols || strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.ResponseWriterWrapper }

// answer returns the response to store, or why it is not stored.
func (rec *recorder) answer(fp string, handlerErr error, lost bool, clientGone bool) (string, string) {
	switch {
	case handlerErr != nil:
		return "", "the route returned an error"
	case lost:
		return "", "the lease was lost"
	case rec.status == 0:
		return "", "no response was written"
	case rec.status >= 500:
		return "", "status " + strconv.Itoa(rec.status)
	case rec.overflow:
		return "", "the body is larger than replay_max"
	case rec.streamed():
		return "", "the response is a stream (server-sent events or a protocol switch)"
	case rec.writeErr != nil || clientGone:
		return "", "the response was aborted"
	}
	hdr := rec.header
	for _, c := range hdr.Values("Connection") {
		for _, name := range strings.Split(c, ",") {
			hdr.Del(strings.TrimSpace(name))
		}
	}
	for _, name := range hopByHop {
		hdr.Del(name)
	}
	hdr.Del(HeaderIdempotentReplayed)
	a := &storedAnswer{Fingerprint: fp, Status: rec.status, Header: hdr, body: rec.body.Bytes()}
	return a.encode(), ""
}

// checkReplayMax checks a replay_max set by hand (0, the default, is not).
func checkReplayMax(n int64) error {
	if n <= 0 {
		return fmt.Errorf("must be positive, got %d", n)
	}
	if n > MaxReplayMax {
		return fmt.Errorf("%d bytes is more than the largest allowed, %d (256MiB): a stored answer is one Redis string (at most 512MB), and the body is kept in memory until it is stored", n, MaxReplayMax)
	}
	return nil
}

// parseSize reads a size such as 1048576, 512KiB, 1MiB, 2MB or 64kb. A
// size that does not fit in an int64 is an error.
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	lower := strings.ToLower(t)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"kb", 1000}, {"mb", 1000 * 1000}, {"gb", 1000 * 1000 * 1000}, {"b", 1}} {
		if strings.HasSuffix(lower, u.suffix) {
			mult, t = u.mult, strings.TrimSpace(t[:len(t)-len(u.suffix)])
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("invalid size %q: want a positive number of bytes, optionally with KiB, MiB, GiB, KB, MB or GB", s)
	}
	if n > math.MaxInt64/mult {
		return 0, fmt.Errorf("invalid size %q: too large", s)
	}
	return n * mult, nil
}

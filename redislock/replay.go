package redislock

// Execute once (`replay`): the holder's response is captured while it
// streams to its own client, stored in Redis by the script that releases
// the lock, and given to every duplicate — waiting or arriving later, in
// any instance — instead of running the route again.

import (
	"bytes"
	"context"
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
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
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

// errBodyTooLarge: under replay the request body is buffered (so the
// route can run to its end when the client goes away, and for the
// default fingerprint); one over replay_max is answered 413.
var errBodyTooLarge = errors.New("redisdlm: request body larger than replay_max")

// conditionalHeaders make a request one whose answer depends on what the
// client already has: it is never answered from, nor stored as, a stored
// answer.
var conditionalHeaders = []string{"Range", "If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since", "If-Range"}

// identity is what a stored answer is matched against: the request's
// fingerprint, its credentials and cookies, and what kind of request it is.
type identity struct {
	fp          string // fingerprint: "" with `fingerprint off`
	cred        string // hash of Authorization, Proxy-Authorization and the credential cookies
	cookie      string // hash of the whole Cookie header
	safe        bool   // GET or HEAD: a request that may not be replayed runs the route itself
	conditional bool   // Range or If-*: never replayed, its answer never stored
}

// bufferBody reads the request body, up to replay_max, and puts it back
// for the route: a client that goes away mid-upload cannot cut the
// route's copy short.
func (h *RedisLock) bufferBody(r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, h.ReplayMax+1))
	if err != nil {
		return nil, fmt.Errorf("reading the request body: %w", err)
	}
	if int64(len(body)) > h.ReplayMax {
		return nil, errBodyTooLarge
	}
	_ = r.Body.Close()
	r.Body = io.NopCloser(bytes.NewReader(body))
	return body, nil
}

// identify buffers the body and returns the request's identity. The
// fingerprint is, by default, the method, the URI, the SHA-256 of the body
// and the credentials; with templates, the rendered templates and the
// credentials; with `fingerprint off`, nothing (private answers still go
// only to the same credentials and cookies).
func (h *RedisLock) identify(r *http.Request, repl *caddy.Replacer) (identity, error) {
	body, err := h.bufferBody(r)
	if err != nil {
		return identity{}, err
	}
	id := identity{
		cred:   h.credentials(r),
		cookie: digest(strings.Join(r.Header.Values("Cookie"), "; ")),
		safe:   r.Method == http.MethodGet || r.Method == http.MethodHead,
	}
	for _, name := range conditionalHeaders {
		if _, ok := r.Header[name]; ok {
			id.conditional = true
		}
	}
	switch {
	case h.fingerprintOff():
	case len(h.Fingerprint) > 0:
		parts := make([]string, len(h.Fingerprint), len(h.Fingerprint)+1)
		for i, t := range h.Fingerprint {
			parts[i] = repl.ReplaceAll(t, "")
		}
		id.fp = digest(strings.Join(append(parts, id.cred), "\x00"))
	default:
		sum := sha256.Sum256(body)
		id.fp = digest(r.Method + "\x00" + r.RequestURI + "\x00" + hex.EncodeToString(sum[:]) + "\x00" + id.cred)
	}
	return id, nil
}

// credentials hashes what identifies the client to the upstream: the
// Authorization and Proxy-Authorization headers and the cookies named by
// credential_cookies (in the order configured).
func (h *RedisLock) credentials(r *http.Request) string {
	var b strings.Builder
	b.WriteString(strings.Join(r.Header.Values("Authorization"), ","))
	b.WriteByte(0)
	b.WriteString(strings.Join(r.Header.Values("Proxy-Authorization"), ","))
	for _, name := range h.CredentialCookies {
		b.WriteByte(0)
		if c, err := r.Cookie(name); err == nil {
			b.WriteString(c.Value)
		}
	}
	return digest(b.String())
}

func (h *RedisLock) fingerprintOff() bool {
	return len(h.Fingerprint) == 1 && h.Fingerprint[0] == "off"
}

func digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// storedAnswer is a response as kept in Redis, with what a later request
// must match to be given it.
type storedAnswer struct {
	Fingerprint string      `json:"f"`
	Status      int         `json:"s"`
	Header      http.Header `json:"h"`
	// Removed names the headers the route took away from those set
	// before the lock (such as Server): a replay removes them too.
	Removed []string `json:"d,omitempty"`
	// Private: Cache-Control private or no-store, or Set-Cookie. Such an
	// answer is replayed only to the same credentials (Cred) and, when no
	// credential cookie is named, the same Cookie header (Cookie).
	Private bool   `json:"p,omitempty"`
	Cred    string `json:"c,omitempty"`
	Cookie  string `json:"k,omitempty"`
	// Vary is the hash of the holder's values of the request headers that
	// the answer's Vary names; VaryBy those names, from the answer as the
	// client saw it (a Vary set before the lock counts too).
	Vary   string   `json:"v,omitempty"`
	VaryBy []string `json:"vn,omitempty"`
	// Head: the answer to a HEAD, which has no body: it answers no other
	// method (a fingerprint without the method would give it to a GET).
	Head bool `json:"hd,omitempty"`
	// Rev is answerRev for an answer that records VaryBy and Head; an
	// answer an earlier version stored has neither (0): its Vary names
	// come from Header, and one that looks like a HEAD's answers no GET.
	Rev  int `json:"r,omitempty"`
	body []byte
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

// varyHash hashes r's values of the request headers names ("" when there
// are none).
func varyHash(names []string, r *http.Request) string {
	if len(names) == 0 {
		return ""
	}
	var b strings.Builder
	for _, n := range names {
		b.WriteString(n)
		b.WriteByte(':')
		b.WriteString(strings.Join(r.Header.Values(n), ","))
		b.WriteByte(0)
	}
	return digest(b.String())
}

// varyNames lists the header names of Vary, canonical and sorted.
func varyNames(answer http.Header) []string {
	var names []string
	for _, v := range answer.Values("Vary") {
		for _, n := range strings.Split(v, ",") {
			if n = strings.TrimSpace(n); n != "" {
				names = append(names, http.CanonicalHeaderKey(n))
			}
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// servable says why a stored answer may not answer this request ("" when
// it may).
func (a *storedAnswer) servable(id identity, r *http.Request, credCookies bool) string {
	switch {
	case a.Status == http.StatusPartialContent || a.Status == http.StatusNotModified:
		return "the stored answer is a " + strconv.Itoa(a.Status)
	case id.conditional:
		return "the request is conditional or a range request"
	case a.Fingerprint != id.fp:
		return "the request differs from the stored one"
	case r.Method != http.MethodHead && a.head():
		return "the stored answer is a HEAD's, without a body"
	case a.Private && a.Cred != id.cred:
		return "the stored answer is private to other credentials"
	case a.Private && !credCookies && a.Cookie != id.cookie:
		return "the stored answer is private to other cookies"
	case a.Vary != varyHash(a.varyBy(), r):
		return "a header the stored answer varies by differs"
	}
	return ""
}

// answerRev marks the answers this version stores (storedAnswer.Rev).
const answerRev = 2

// varyBy names the request headers the answer varies by.
func (a *storedAnswer) varyBy() []string {
	if a.Rev >= answerRev || a.VaryBy != nil {
		return a.VaryBy
	}
	return varyNames(a.Header)
}

// head reports an answer to a HEAD: so marked, or stored by an earlier
// version with no body where its status has one and its Content-Length
// says there was one.
func (a *storedAnswer) head() bool {
	if a.Head || a.Rev >= answerRev {
		return a.Head
	}
	cl := a.Header.Get("Content-Length")
	return len(a.body) == 0 && bodyAllowed(a.Status) && cl != "" && cl != "0"
}

// mayServe decodes a stored answer and reports whether it may answer r;
// why is the reason when it may not.
func (h *RedisLock) mayServe(r *http.Request, id identity, stored string) (a *storedAnswer, why string, err error) {
	a, err = decodeAnswer(stored)
	if err != nil {
		return nil, "", err
	}
	return a, a.servable(id, r, len(h.CredentialCookies) > 0), nil
}

// serveReplay answers r with a stored answer that mayServe allowed.
func (h *RedisLock) serveReplay(w http.ResponseWriter, r *http.Request, display string, a *storedAnswer) error {
	h.m.Replayed.Inc()
	if c := h.logger.Check(zapcore.DebugLevel, "replaying stored response"); c != nil {
		c.Write(zap.String("key", display), zap.Int("status", a.Status))
	}
	// The headers the route set, and none it removed (what handlers
	// before the lock set for this request, such as a request id, stay
	// this request's own).
	hdr := w.Header()
	for _, k := range a.Removed {
		hdr.Del(k)
	}
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

// refuseReplay answers a request that may not be given the stored answer
// of its key: an unsafe method gets 422 (running it would run the key's
// request a second time); a GET or HEAD runs the route itself, without
// the lock (coalescing is an optimisation, not exclusion).
func (h *RedisLock) refuseReplay(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, id identity, display, why string) error {
	h.m.Mismatch.Inc()
	if id.safe {
		if c := h.logger.Check(zapcore.DebugLevel, "replay: stored answer not for this request; running the route without the lock"); c != nil {
			c.Write(zap.String("key", display), zap.String("reason", why))
		}
		h.setFencingHeader(r, "")
		return next.ServeHTTP(w, r)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "replay: request differs from the stored one; answering 422"); c != nil {
		c.Write(zap.String("key", display), zap.String("reason", why))
	}
	return caddyhttp.Error(http.StatusUnprocessableEntity,
		errors.New("redisdlm: this key was used with another request (method, URI, body or credentials differ)"))
}

// bodyAllowed reports whether a response of this status has a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// cacheableByDefault are the statuses HTTP caching may store without
// explicit freshness (RFC 9110 §15.1): the only ones kept for GET/HEAD,
// so one client's 400 is never served to the next.
var cacheableByDefault = []int{200, 203, 204, 300, 301, 308, 404, 405, 410, 414}

// neverStored are transient answers (and the answers to conditional or
// range requests), stored for no method.
var neverStored = []int{http.StatusPartialContent, http.StatusNotModified, http.StatusRequestTimeout,
	http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests}

// recorder passes a response on to the client and keeps a copy of it, up
// to max bytes of body, for replay. Once the client is gone (a write
// fails, or its request context ends) it swallows writes and flushes and
// keeps recording, so the route runs to its end and its answer is stored.
type recorder struct {
	*caddyhttp.ResponseWriterWrapper
	max     int64
	client  context.Context // the client's own request context
	before  http.Header     // the header as handlers before the lock left it
	status  int
	header  http.Header // what the route set, copied when the header is written
	removed []string    // headers set before the lock that the route removed
	// Of the header as the client got it (also the fields set before the
	// lock, e.g. by the header directive): Cache-Control private or
	// no-store, or Set-Cookie; and the request headers its Vary names.
	private  bool
	varyBy   []string
	body     bytes.Buffer
	overflow bool // the body outgrew max
	gone     bool // the client went away: nothing more is sent to it
	// withhold, when set, is asked as the answer starts (status below
	// 500): true keeps the whole answer back (withheld) until the
	// release decides whether it may go out (sendWithheld).
	withhold func() bool
	withheld bool
}

// newRecorder records what the route writes to w; before is w's header as
// handlers before the lock left it, client the client's request context.
func newRecorder(w http.ResponseWriter, client context.Context, max int64, before http.Header) *recorder {
	return &recorder{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, client: client, max: max, before: before}
}

// clientGone reports (and remembers) whether the client went away.
func (rec *recorder) clientGone() bool {
	if !rec.gone && rec.client.Err() != nil {
		rec.gone = true
	}
	return rec.gone
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
		for k := range rec.before {
			if _, ok := rec.Header()[k]; !ok {
				rec.removed = append(rec.removed, k)
			}
		}
		slices.Sort(rec.removed)
		rec.private, rec.varyBy = privateAnswer(rec.Header()), varyNames(rec.Header())
		rec.withheld = code < 500 && rec.withhold != nil && rec.withhold()
	}
	if rec.clientGone() || rec.withheld {
		return
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
	if rec.clientGone() || rec.withheld {
		return len(b), nil
	}
	if _, err := rec.ResponseWriterWrapper.Write(b); err != nil {
		rec.gone = true // the client went away mid-response
	}
	return len(b), nil
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
	if rec.clientGone() || rec.withheld {
		return
	}
	if err := http.NewResponseController(rec.ResponseWriterWrapper).Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		rec.gone = true
	}
}

// sendWithheld sends the withheld answer (stored whole, so its body is
// all there).
func (rec *recorder) sendWithheld() {
	rec.withheld = false
	if rec.clientGone() {
		return
	}
	rec.ResponseWriterWrapper.WriteHeader(rec.status)
	_, _ = rec.ResponseWriterWrapper.Write(rec.body.Bytes())
}

// streamed reports an answer that is a stream by nature (server-sent
// events, a protocol switch): never replayed.
func (rec *recorder) streamed() bool {
	ct, _, _ := strings.Cut(rec.header.Get("Content-Type"), ";")
	return rec.status == http.StatusSwitchingProtocols || strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.ResponseWriterWrapper }

// storable says why the recorded answer to a request of identity id may
// not be stored ("" when it may).
func (rec *recorder) storable(id identity, handlerErr error, lost bool) string {
	switch {
	case handlerErr != nil:
		return "the route returned an error (the response was aborted)"
	case lost:
		return "the lease was lost, or the route panicked"
	case rec.status == 0:
		return "no response was written"
	case rec.status >= 500:
		return "status " + strconv.Itoa(rec.status)
	case slices.Contains(neverStored, rec.status):
		return "status " + strconv.Itoa(rec.status) + " is never stored"
	case id.conditional:
		return "the request is conditional or a range request"
	case id.safe && !slices.Contains(cacheableByDefault, rec.status):
		return "status " + strconv.Itoa(rec.status) + " is not stored for GET or HEAD"
	case slices.Contains(rec.varyBy, "*"):
		return "the response varies by every header (Vary: *)"
	case rec.overflow:
		return "the body is larger than replay_max"
	case rec.streamed():
		return "the response is a stream (server-sent events or a protocol switch)"
	}
	return ""
}

// answer returns the response to store, or why it is not stored.
func (rec *recorder) answer(r *http.Request, id identity, handlerErr error, lost bool) (string, string) {
	if why := rec.storable(id, handlerErr, lost); why != "" {
		return "", why
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
	a := &storedAnswer{Fingerprint: id.fp, Status: rec.status, Header: hdr, Removed: rec.removed,
		Private: rec.private, Vary: varyHash(rec.varyBy, r), VaryBy: rec.varyBy, Head: r.Method == http.MethodHead,
		Rev: answerRev, body: rec.body.Bytes()}
	if a.Private {
		a.Cred, a.Cookie = id.cred, id.cookie
	}
	return a.encode(), ""
}

// privateAnswer reports an answer meant for one client: Cache-Control
// private or no-store, or a Set-Cookie.
func privateAnswer(hdr http.Header) bool {
	if len(hdr.Values("Set-Cookie")) > 0 {
		return true
	}
	for _, v := range hdr.Values("Cache-Control") {
		for _, d := range strings.Split(v, ",") {
			d, _, _ = strings.Cut(strings.TrimSpace(d), "=")
			if strings.EqualFold(d, "private") || strings.EqualFold(d, "no-store") {
				return true
			}
		}
	}
	return false
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

// errAnswerWithheld answers a holder whose answer was withheld and could
// not be stored as its run's own (see releaseWithheld).
var errAnswerWithheld = errors.New("redisdlm: the lease ended before the answer could go out, and it could not be stored as this run's own; the key's outcome is in doubt")

// errRunInDoubt is logged for a duplicate refused while the key's run is in
// doubt.
var errRunInDoubt = errors.New("redisdlm: a request with this key began earlier and its outcome is unknown (its holder lost its lease before an answer was stored)")

// transientStatuses say that the request was not acted on: under replay
// they clear the key's run record (as a 5xx the route wrote does).
var transientStatuses = []int{http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests}

// runDidNotHappen reports an end of a run (replay, an unsafe method) that
// says the upstream did not act on it or failed, so a duplicate may run:
// reverse_proxy could not connect, or the route itself wrote a 5xx or a
// transient 408, 409, 425 or 429 (also after the lease was lost, with
// on_lost continue). Any other unstored end leaves the key in doubt: an
// error after the upstream may have begun (a broken upstream connection, a
// cancelled context: on_lost cancel's 503), a panic, a detached run cut
// off, an answer that cannot be stored.
func runDidNotHappen(end routeEnd, rec *recorder) bool {
	if end.err != nil {
		var dial reverseproxy.DialError
		return errors.As(end.err, &dial)
	}
	if end.panicked || end.cutOff {
		return false
	}
	return rec.status >= 500 || slices.Contains(transientStatuses, rec.status)
}

// releaseWithheld ends a run whose answer was withheld: it began after the
// holder's own clock said its lease ended, so a duplicate may have been
// refused as in doubt meanwhile, and only the answer stored as this run's
// own may go out. It is stored over the run's own record (or while the
// lease still holds), then sent; otherwise the client gets 503 (returned)
// and the key stays in doubt, unless the answer cleared it.
func (h *RedisLock) releaseWithheld(hd held, rec *recorder, ans, why string) error {
	stored := false
	if ans != "" {
		var err error
		if stored, err = hd.lease.KeepAnswer(context.Background(), ans); err != nil {
			why = "storing it failed: " + err.Error()
		} else if !stored {
			why = "the key's run record is no longer this run's"
		}
	}
	hd.lease.ReleaseInBackground("")
	if stored {
		h.m.Stored.Inc()
		rec.sendWithheld()
		return nil
	}
	h.m.NotStored.Inc()
	h.logger.Warn("replay: the lease ended before the answer could go out and the answer could not be stored; answering 503",
		zap.String("reason", why), zap.Int("status", rec.status))
	return caddyhttp.Error(http.StatusServiceUnavailable, errAnswerWithheld)
}

// runRefused answers a request whose key's run was started by another
// request (replay, an unsafe method): its outcome in doubt gets 409 with a
// short reason (a problem+json body, as the Idempotency-Key draft asks)
// and Retry-After; another request's run gets what a mismatch gets.
// refused is false for any other error (nothing was answered).
func (h *RedisLock) runRefused(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, id identity, display string, err error) (refused bool, _ error) {
	var doubt *lock.InDoubtError
	switch {
	case errors.As(err, &doubt):
		h.m.InDoubt.Inc()
		if c := h.logger.Check(zapcore.DebugLevel, "replay: the key's run is in doubt; answering 409"); c != nil {
			c.Write(zap.String("key", display), zap.Duration("record_left", doubt.RecordLeft()))
		}
		w.Header().Set("Retry-After", strconv.FormatInt(shared.RetryAfterSeconds(shared.Jittered(h.inDoubtRetry(doubt.RecordLeft()), h.Jitter)), 10))
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, `{"type":"about:blank","title":"Conflict","status":409,"detail":"a request with this key began earlier and its outcome is unknown; it is not run again"}`+"\n")
		return true, nil
	case errors.Is(err, lock.ErrRunMismatch):
		return true, h.refuseReplay(w, r, next, id, display, "the key's run was started by another request")
	}
	return false, nil
}

// inDoubtRetry is the Retry-After of a refusal while the key's run is in
// doubt: one ttl (a holder that was paused and comes back stores its
// answer by then, and the retry is replayed), or what is left of the run
// record when that is sooner (then the key may run again).
func (h *RedisLock) inDoubtRetry(recordLeft time.Duration) time.Duration {
	return min(time.Duration(h.TTL), recordLeft)
}

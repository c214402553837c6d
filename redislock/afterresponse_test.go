package redislock

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/redis/go-redis/v9"
)

// TestWholeCaddyReleaseAfterResponse: an HTTP/1 request's lock is released
// once its response is on the wire (from the connection's hook), on a
// keep-alive connection, one that closes after the response, with two
// locks in one route, and for a connection hijacked while the route ran (an
// upgrade through reverse_proxy) as the handler returns; HTTP/2 releases as the handler
// returns. Every lock is released (within seconds, with a ttl of 30s and a
// wait of 2s that a lock left held would make fail), none is left held.
func TestWholeCaddyReleaseAfterResponse(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	rc := r.Client()

	// The upgrade upstream: 101, a line, then it closes the connection.
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Header.Get("Upgrade") == "" {
			fmt.Fprint(w, "plain")
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("upstream hijack: %v", err)
			return
		}
		defer conn.Close()
		fmt.Fprint(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\nhello\n")
		brw.Flush()
		time.Sleep(100 * time.Millisecond)
	}))
	defer up.Close()

	// Once Caddy stopped (testkit.RunCaddy's cleanup runs before this one), no
	// server is kept: each is forgotten with its last handler.
	t.Cleanup(func() {
		n := 0
		afterResponse.servers.Range(func(any, any) bool { n++; return true })
		if n != 0 {
			t.Errorf("%d servers still known after Caddy stopped", n)
		}
	})
	port := freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin off
	auto_https off
	servers {
		protocols h1 h2c
	}
}
&(named) {
	redis_lock {
		key {http.request.uri.path}
		ttl 30s
		wait 2s
		redis %[2]s
	}
}
:%[1]d {
	handle /two/* {
		redis_lock {
			key {http.request.uri.path}
			ttl 30s
			wait 2s
			redis %[2]s
		}
		redis_lock {
			key second-{http.request.uri.path}
			ttl 30s
			wait 2s
			redis %[2]s
		}
		respond "two"
	}
	handle /up/* {
		redis_lock {
			key {http.request.uri.path}
			ttl 30s
			wait 2s
			redis %[2]s
		}
		reverse_proxy %[3]s
	}
	handle /big/* {
		redis_lock {
			key {http.request.uri.path}
			ttl 30s
			wait 3s
			redis %[2]s
		}
		respond "%[4]s"
	}
	handle /named/* {
		invoke named
		respond "named"
	}
	handle {
		redis_lock {
			key {http.request.uri.path}
			ttl 30s
			wait 2s
			redis %[2]s
		}
		respond "ok"
	}
}
`, port, r.Addr, strings.TrimPrefix(up.URL, "http://"), strings.Repeat("x", 1000)))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)

	held := func(key string) bool { return lockKeyHeld(rc, key) }
	released := func(what string, keys ...string) {
		t.Helper()
		for _, k := range keys {
			if !waitFor(5*time.Second, func() bool { return !held(k) }) {
				t.Errorf("%s: the lock of %s is still held", what, k)
			}
		}
	}
	do := func(c *http.Client, req *http.Request, want string) *http.Response {
		t.Helper()
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", req.URL.Path, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != want {
			t.Fatalf("%s: %d %q, want 200 %q", req.URL.Path, resp.StatusCode, b, want)
		}
		return resp
	}
	newReq := func(path string) *http.Request {
		req, _ := http.NewRequest(http.MethodGet, base+path, nil)
		return req
	}

	// n requests on one client, each answered want, every release run from
	// a hook (want per request) and every key released afterwards. Over one
	// keep-alive connection, each request finds the lock free: one left
	// held would keep the next waiting past its 2s wait.
	for _, c := range []struct {
		name, path, want string
		client           *http.Client
		n, perRequest    int
		keys             []string
	}{
		{"keep-alive", "/ka", "ok", &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}, 20, 1, []string{"/ka"}},
		{"connection close", "/close", "ok", &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}, 5, 1, []string{"/close"}},
		{"two locks in one route", "/two/x", "two", &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}, 5, 2, []string{"/two/x", "second-/two/x"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := afterResponse.ran.Load()
			for i := 0; i < c.n; i++ {
				do(c.client, newReq(c.path), c.want)
			}
			released(c.name, c.keys...)
			if n, want := afterResponse.ran.Load()-before, int64(c.n*c.perRequest); n < want {
				t.Errorf("%d of %d releases ran after their response, want all", n, want)
			}
		})
	}
	t.Run("hijacked", func(t *testing.T) {
		before := afterResponse.ran.Load()
		for i := 0; i < 3; i++ {
			conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(conn, "GET /up/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n")
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
				t.Fatalf("upgrade: %v %v", resp, err)
			}
			if line, err := br.ReadString('\n'); err != nil || line != "hello\n" {
				t.Fatalf("upgraded stream: %q %v", line, err)
			}
			// Both ends close: reverse_proxy's handler returns, and the lock
			// of a connection hijacked while the route ran is released then
			// (net/http reports no state of it any more).
			conn.Close()
			released("hijacked", "/up/ws")
		}
		do(http.DefaultClient, newReq("/up/plain"), "plain")
		released("after the upgrades", "/up/ws", "/up/plain")
		if n := afterResponse.ran.Load() - before; n != 1 {
			t.Errorf("%d releases ran from a hook, want 1 (the request that was not upgraded)", n)
		}
	})
	t.Run("with a body", func(t *testing.T) {
		// net/http drains an unread body before it reports the connection
		// idle: a request with one releases as the handler returns.
		c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
		before := afterResponse.ran.Load()
		for i := 0; i < 5; i++ {
			req, _ := http.NewRequest(http.MethodPost, base+"/body", strings.NewReader("unread body"))
			do(c, req, "ok")
		}
		released("with a body", "/body")
		if n := afterResponse.ran.Load() - before; n != 0 {
			t.Errorf("%d releases of requests with a body waited for a connection state, want none", n)
		}
	})
	t.Run("client stops reading", func(t *testing.T) {
		// A client pipelines requests for one key and reads none of the
		// answers (each fits net/http's buffers, so the handler never
		// blocks): once the connection's buffers are full, an answer's
		// last write blocks after its handler returned, and its release is
		// sent waitBound later. Another client then gets the key within its
		// wait of 3s (not the ttl of 30s).
		before := afterResponse.overdue.Load()
		conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.(*net.TCPConn).SetReadBuffer(4096)
		go func() {
			req := []byte("GET /big/k HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
			for i := 0; i < 5000; i++ {
				if _, err := conn.Write(req); err != nil {
					return
				}
			}
		}()
		if !waitFor(20*time.Second, func() bool { return afterResponse.overdue.Load() > before }) {
			t.Fatal("no release was sent past waitBound, though the client reads nothing")
		}
		do(&http.Client{}, newReq("/big/k"), strings.Repeat("x", 1000))
	})
	t.Run("named route", func(t *testing.T) {
		// Provisioned with its server or not, it releases.
		c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
		for i := 0; i < 5; i++ {
			do(c, newReq("/named/x"), "named")
		}
		released("named route", "/named/x")
	})
	t.Run("http2", func(t *testing.T) {
		tr := &http.Transport{Protocols: new(http.Protocols)}
		tr.Protocols.SetUnencryptedHTTP2(true)
		c := &http.Client{Transport: tr}
		before := afterResponse.ran.Load()
		for i := 0; i < 5; i++ {
			if resp := do(c, newReq("/h2"), "ok"); resp.ProtoMajor != 2 {
				t.Fatalf("answered over HTTP/%d, want 2", resp.ProtoMajor)
			}
		}
		released("http2", "/h2")
		if n := afterResponse.ran.Load() - before; n != 0 {
			t.Errorf("%d HTTP/2 releases waited for a connection state, want none", n)
		}
	})
	if n := afterResponse.pending.Load(); n != 0 {
		t.Errorf("%d releases still wait for a response", n)
	}
}

// TestWholeCaddyReleaseAfterResponseFaults: a release waiting for its
// response still reaches Redis when Caddy reloads its config while the
// route runs (the old server's hook answers it), and when Redis is paused
// as the release is sent (it goes out again once Redis answers).
func TestWholeCaddyReleaseAfterResponseFaults(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	rc := r.Client()
	arrived := make(chan string, 4)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		arrived <- req.URL.Path
		time.Sleep(300 * time.Millisecond)
		fmt.Fprint(w, "slow")
	}))
	defer up.Close()
	port := freePort(t)
	conf := func(version string) string {
		return fmt.Sprintf(`{
	admin off
	auto_https off
}
:%d {
	header X-Version %s
	redis_lock {
		key {http.request.uri.path}
		ttl 30s
		wait 3s
		redis %s
	}
	reverse_proxy %s
}
`, port, version, r.Addr, strings.TrimPrefix(up.URL, "http://"))
	}
	testkit.RunCaddy(t, conf("v1"))
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	held := func(key string) bool { return lockKeyHeld(rc, key) }
	// slow sends one request for path and runs fault while the upstream
	// has it; the request must be answered, its lock released afterwards,
	// and the key free for the next request.
	slow := func(t *testing.T, path string, fault func()) {
		t.Helper()
		before := afterResponse.ran.Load()
		done := make(chan error, 1)
		go func() {
			resp, err := http.Get(base + path)
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || string(b) != "slow" {
					err = fmt.Errorf("%d %q", resp.StatusCode, b)
				}
			}
			done <- err
		}()
		select {
		case <-arrived:
		case <-time.After(5 * time.Second):
			t.Fatal("the request never reached the upstream")
		}
		fault()
		if err := <-done; err != nil {
			t.Fatalf("the request under the fault: %v", err)
		}
		if !waitFor(10*time.Second, func() bool { return !held(path) }) {
			t.Fatalf("the lock of %s is still held", path)
		}
		if afterResponse.ran.Load() == before {
			t.Error("the release was not sent from the connection's hook")
		}
		if resp, body := get(t, base+path); resp == nil || resp.StatusCode != 200 || body != "slow" {
			t.Fatalf("the next request for the key: %v %q", resp, body)
		}
		<-arrived
	}
	t.Run("reload while the route runs", func(t *testing.T) {
		slow(t, "/reload", func() {
			cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(conf("v2")), nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := caddy.Load(cfg, true); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("redis paused as the release is sent", func(t *testing.T) {
		slow(t, "/pause", func() {
			r.Pause()
			time.AfterFunc(1500*time.Millisecond, r.Resume)
		})
	})
}

// lockKeyHeld reports whether Redis has a key of the lock of the rendered
// key (or cannot say: an error counts as held).
func lockKeyHeld(rc *redis.Client, key string) bool {
	ks, err := rc.Keys(context.Background(), "*{"+key+"}").Result()
	return err != nil || len(ks) > 0
}

// addrConn is a connection with the remote address of a test's choosing.
type addrConn struct {
	net.Conn
	addr net.Addr
}

func (c *addrConn) RemoteAddr() net.Addr { return c.addr }

// A request finds its TCP connection by its RemoteAddr, noted as the
// connection became active (once, whatever its requests); while two open
// connections share one address, and for a connection that is not TCP (a
// Unix socket's all say "@"), it finds it in the context instead, where the
// ConnContext hook put it; a connection that closed is forgotten, and its
// waiting releases are answered.
func TestResponseWaitsFindConn(t *testing.T) {
	a := &responseWaits{conns: map[net.Conn]*responseWait{}}
	hook := &serverHook{byAddr: map[string]openConn{}, addrOf: map[net.Conn]string{}}
	hook.live.Store(true)
	tcp := func(s string) net.Addr { return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s)) }
	c1 := &addrConn{addr: tcp("127.0.0.1:40001")}
	c2 := &addrConn{addr: tcp("127.0.0.1:40002")}
	c3 := &addrConn{addr: tcp("127.0.0.1:40002")} // c2's address, on another listener
	u1 := &addrConn{addr: &net.UnixAddr{Name: "@", Net: "unix"}}
	u2 := &addrConn{addr: &net.UnixAddr{Name: "@", Net: "unix"}}
	req := func(addr string, ctxConn net.Conn) *http.Request {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = addr
		if ctxConn != nil {
			r = r.WithContext(context.WithValue(r.Context(), connCtxKey{}, ctxConn))
		}
		return r
	}
	found := func(r *http.Request) net.Conn {
		t.Helper()
		var w responseWait
		if !a.begin(r, hook, &w) {
			return nil
		}
		return w.conn
	}
	hook.note(c1)
	hook.note(c1) // its next request
	if got := found(req("127.0.0.1:40001", nil)); got != c1 {
		t.Fatalf("a request of c1 without the context value found %v, want c1 by its address", got)
	}
	if got := found(req("127.0.0.1:40002", nil)); got != nil {
		t.Fatalf("a request of an address with no open connection found %v", got)
	}
	hook.note(c2)
	hook.note(c3)
	if got := found(req("127.0.0.1:40002", c3)); got != c3 {
		t.Fatalf("a request of c3, which shares its address with c2, found %v, want c3 from the context", got)
	}
	if got := found(req("127.0.0.1:40002", nil)); got != nil {
		t.Fatalf("a request of an address two connections share, without the context value, found %v", got)
	}
	hook.forget(c3)
	if got := found(req("127.0.0.1:40002", c2)); got != c2 {
		t.Fatalf("after one of two connections of an address closed, a request found %v, want c2 from the context (which one is left is not known)", got)
	}
	hook.forget(c2)
	hook.note(u1)
	hook.note(u2)
	if got := found(req("@", u2)); got != u2 {
		t.Fatalf("a request on a Unix socket found %v, want its own connection from the context", got)
	}
	if len(hook.byAddr) != 1 {
		t.Fatalf("byAddr = %v, want only c1's (Unix connections are not noted by address)", hook.byAddr)
	}
	hook.note(c2)
	if got := found(req("127.0.0.1:40002", nil)); got != c2 {
		t.Fatalf("a request of the address reopened found %v, want c2", got)
	}
	w1 := a.conns[c1]
	a.written(c1) // what the hook does for StateClosed, after forget
	hook.forget(c1)
	if w1 == nil || !w1.done || a.conns[c1] != nil {
		t.Fatal("closing c1 did not answer its waits")
	}
	if got := found(req("127.0.0.1:40001", nil)); got != nil {
		t.Fatalf("a request of a closed connection's address found %v", got)
	}
	for _, c := range []net.Conn{c2, u1, u2} {
		hook.forget(c)
	}
	if len(hook.byAddr) != 0 || len(hook.addrOf) != 0 {
		t.Fatalf("after every connection closed: byAddr %v, addrOf %v, want both empty", hook.byAddr, hook.addrOf)
	}
}

// TestWholeCaddyReleaseAfterResponseProxyProtocol: behind Caddy's
// proxy_protocol listener wrapper, a connection whose PROXY header has not
// come yet holds up no other (the connection hooks never wait on a
// connection in net/http's accept loop: its RemoteAddr waits for the
// header), and a locked request, known by the address its header gives, is
// released after its response.
func TestWholeCaddyReleaseAfterResponseProxyProtocol(t *testing.T) {
	testkit.SkipWholeCaddyIfShort(t)
	r := startRedis(t)
	rc := r.Client()
	port := freePort(t)
	testkit.RunCaddy(t, fmt.Sprintf(`{
	admin off
	auto_https off
	servers {
		listener_wrappers {
			proxy_protocol {
				timeout 5s
				allow 127.0.0.1/32
			}
		}
	}
}
:%d {
	redis_lock {
		key {http.request.uri.path}
		ttl 30s
		wait 2s
		redis %s
	}
	respond "ok"
}`, port, r.Addr))
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	silent, err := net.Dial("tcp", addr) // sends no PROXY header
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	time.Sleep(100 * time.Millisecond) // accepted, its header awaited
	for i := range 3 {
		before := afterResponse.ran.Load()
		start := time.Now()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(c, "PROXY TCP4 10.1.2.3 127.0.0.1 %d %d\r\nGET /pp/%d HTTP/1.1\r\nHost: x\r\n\r\n", 40000+i, port, i)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 100))
		resp.Body.Close()
		took := time.Since(start)
		if resp.StatusCode != 200 || string(body) != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
		if took > 2500*time.Millisecond {
			t.Fatalf("request %d answered after %v with a connection waiting for its PROXY header (timeout 5s): the accept loop waited on it", i, took)
		}
		if !waitFor(5*time.Second, func() bool { return afterResponse.ran.Load() > before }) {
			t.Fatalf("request %d: its release was not sent after its response (from the connection's hook)", i)
		}
		if !waitFor(5*time.Second, func() bool { return !lockKeyHeld(rc, fmt.Sprintf("/pp/%d", i)) }) {
			t.Fatalf("request %d: its lock is still held", i)
		}
		// Known by the address of its PROXY header.
		proxied := fmt.Sprintf("10.1.2.3:%d", 40000+i)
		if n := hooksFinding(proxied); n != 1 {
			t.Fatalf("request %d: %d servers know an open connection of %s, want 1", i, n, proxied)
		}
		c.Close()
		if !waitFor(5*time.Second, func() bool { return hooksFinding(proxied) == 0 }) {
			t.Fatalf("request %d: its connection is still known after it closed", i)
		}
	}
}

// hooksFinding counts the servers that know an open connection of addr.
func hooksFinding(addr string) int {
	n := 0
	afterResponse.servers.Range(func(_, v any) bool {
		if v.(*serverHook).find(addr) != nil {
			n++
		}
		return true
	})
	return n
}

// Package testredis starts real redis-server processes for tests: each
// on a free loopback port, stopped when its test ends. Every package's
// tests share it. A test that needs a server fails (never skips) when
// redis-server is not installed.
package testredis

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is a real redis-server process on a free loopback port, started
// for one test and stopped when it ends.
type Server struct {
	t    testing.TB
	Port int
	Addr string
	args []string
	dir  string
	cmd  *exec.Cmd
	// exited is closed when the process ended (its Wait returned).
	exited chan struct{}
}

// FreePort returns a free loopback port p such that p and p+10000 (a
// Cluster node's bus port) are both below the kernel's ephemeral range
// (32768 up, where every outgoing connection takes its local port): a port
// from that range, freed again, may be taken by a client connection before
// redis-server binds it, or before a killed server restarts on it. Each
// port is handed out once per test binary.
func FreePort(t testing.TB) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		p := 10000 + rand.IntN(12768)
		if portsGiven[p] || portsGiven[p+10000] || !canBind(p) || !canBind(p+10000) {
			continue
		}
		portsGiven[p], portsGiven[p+10000] = true, true
		return p
	}
	t.Fatal("no free loopback port in 10000-22767")
	return 0
}

// canBind reports whether a loopback port is free at the moment.
func canBind(p int) bool {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

var (
	portsMu    sync.Mutex
	portsGiven = map[int]bool{}
)

// Start starts redis-server; extra args are passed as config
// (e.g. "--requirepass", "secret"). It fails the test loudly when
// redis-server is not installed.
func Start(t testing.TB, args ...string) *Server {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("redis-server is required for this test and was not found in PATH (make test installs it): %v", err)
	}
	r := &Server{t: t, args: args, dir: t.TempDir()}
	r.Port = FreePort(t)
	r.Addr = "127.0.0.1:" + strconv.Itoa(r.Port)
	r.start()
	t.Cleanup(r.Kill)
	t.Cleanup(r.dumpLogOnFailure)
	return r
}

// dumpLogOnFailure prints the end of the server's log when the test failed.
func (r *Server) dumpLogOnFailure() {
	if !r.t.Failed() {
		return
	}
	b, err := os.ReadFile(filepath.Join(r.dir, "redis.log"))
	if err != nil {
		return
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	r.t.Logf("log of %s:\n%s", r, b)
}

// StartOnPort starts a server on a port chosen before (to test "Redis
// comes up after Caddy").
func StartOnPort(t testing.TB, port int, args ...string) *Server {
	t.Helper()
	r := &Server{t: t, args: args, dir: t.TempDir(), Port: port, Addr: "127.0.0.1:" + strconv.Itoa(port)}
	r.start()
	t.Cleanup(r.Kill)
	t.Cleanup(r.dumpLogOnFailure)
	return r
}

func (r *Server) start() {
	r.t.Helper()
	a := append([]string{"--port", strconv.Itoa(r.Port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", r.dir, "--daemonize", "no", "--loglevel", "warning",
		// A replica syncs at once (the default waits 5s for more replicas).
		"--repl-diskless-sync-delay", "0"}, r.args...)
	r.cmd = exec.Command("redis-server", a...)
	// The server's own log goes to a file, shown only when the test fails.
	logf, err := os.OpenFile(filepath.Join(r.dir, "redis.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		r.t.Fatalf("redis log file: %v", err)
	}
	defer logf.Close()
	r.cmd.Stdout, r.cmd.Stderr = logf, logf
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		r.t.Fatalf("starting redis-server: %v", err)
	}
	cmd, exited := r.cmd, make(chan struct{})
	r.exited = exited
	go func() { _ = cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			log, _ := os.ReadFile(filepath.Join(r.dir, "redis.log"))
			r.t.Fatalf("redis-server on %s exited at start:\n%s", r.Addr, log)
		default:
		}
		c, err := net.DialTimeout("tcp", r.Addr, 200*time.Millisecond)
		if err == nil {
			_, _ = c.Write([]byte("PING\r\n"))
			buf := make([]byte, 64)
			_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			n, _ := c.Read(buf)
			c.Close()
			if n > 0 && (strings.HasPrefix(string(buf[:n]), "+PONG") || strings.HasPrefix(string(buf[:n]), "-NOAUTH")) {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.t.Fatalf("redis-server on %s did not answer within 10s", r.Addr)
}

// Kill stops the server at once (SIGKILL); safe to call twice.
func (r *Server) Kill() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	_ = r.cmd.Process.Signal(syscall.SIGCONT)
	_ = r.cmd.Process.Kill()
	<-r.exited
	r.cmd = nil
}

// Restart starts the server again on the same port, empty.
func (r *Server) Restart() {
	r.Kill()
	r.start()
}

// Pause freezes the server with SIGSTOP: connections stay open, nothing answers.
func (r *Server) Pause() { _ = r.cmd.Process.Signal(syscall.SIGSTOP) }

// Resume undoes Pause.
func (r *Server) Resume() { _ = r.cmd.Process.Signal(syscall.SIGCONT) }

// Client returns a plain go-redis client for inspecting the server.
func (r *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: r.Addr, DialTimeout: 2 * time.Second, ReadTimeout: 2 * time.Second})
	r.t.Cleanup(func() { c.Close() })
	return c
}

// CommandCalls returns the calls of one command from INFO commandstats
// (e.g. "evalsha"); counts include commands run inside scripts for those.
func (r *Server) CommandCalls(name string) int64 {
	info, err := r.Client().Info(context.Background(), "commandstats").Result()
	if err != nil {
		r.t.Fatalf("info commandstats: %v", err)
	}
	prefix := "cmdstat_" + strings.ToLower(name) + ":calls="
	for _, line := range strings.Split(info, "\n") {
		if strings.HasPrefix(line, prefix) {
			v := strings.TrimPrefix(line, prefix)
			if i := strings.IndexByte(v, ','); i > 0 {
				v = v[:i]
			}
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

func (r *Server) String() string { return fmt.Sprintf("redis@%s", r.Addr) }

// AwaitUptime waits until the server's process has run for at least d
// (INFO's uptime, whole seconds): a fence knows when its Redis started only
// to the second, and refuses tokens issued in the process's first seconds.
func (r *Server) AwaitUptime(d time.Duration) {
	r.t.Helper()
	c := r.Client()
	deadline := time.Now().Add(d + 20*time.Second)
	for time.Now().Before(deadline) {
		if info, err := c.Info(context.Background(), "server").Result(); err == nil {
			for _, line := range strings.Split(info, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(line), "uptime_in_seconds:"); ok {
					if up, _ := strconv.Atoi(v); time.Duration(up)*time.Second >= d {
						return
					}
				}
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.t.Fatalf("%s never reported an uptime of %v", r, d)
}

// Micros is the server's TIME in µs: a fencing token as a lock on it would
// issue it now.
func (r *Server) Micros() int64 {
	r.t.Helper()
	now, err := r.Client().Time(context.Background()).Result()
	if err != nil {
		r.t.Fatalf("%s: TIME: %v", r, err)
	}
	return now.UnixMicro()
}

// WaitFor polls cond every 5ms until it holds (true) or d passed (false).
func WaitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// InfoInt reads one integer field of an INFO section through c.
func InfoInt(tb testing.TB, c *redis.Client, section, field string) int64 {
	tb.Helper()
	info, err := c.Info(context.Background(), section).Result()
	if err != nil {
		tb.Fatalf("info %s: %v", section, err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	tb.Fatalf("no %s in INFO %s", field, section)
	return 0
}

// StartRedlock starts n independent redis-servers (a Redlock's) and returns
// them with the JSON list of their addresses.
func StartRedlock(t testing.TB, n int) ([]*Server, string) {
	t.Helper()
	var rs []*Server
	var addrs []string
	for i := 0; i < n; i++ {
		r := Start(t)
		rs = append(rs, r)
		addrs = append(addrs, `"`+r.Addr+`"`)
	}
	return rs, "[" + strings.Join(addrs, ",") + "]"
}

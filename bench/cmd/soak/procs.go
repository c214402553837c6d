package main

// Child processes: redis-server and Caddy, started on loopback ports and
// killed when the soak ends, fails or is interrupted.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-dlm/redisdlm/bench/internal/proc"

	"github.com/redis/go-redis/v9"
)

// spawnReq asks the spawner goroutine to start a process.
type spawnReq struct {
	cmd  *exec.Cmd
	done chan error
}

var (
	spawnCh  = make(chan spawnReq)
	childMu  sync.Mutex
	children = map[*exec.Cmd]struct{}{}
	workDir  string
)

// spawner starts every child from one goroutine locked to its OS thread for
// the life of the process: Pdeathsig fires when the *thread* that started a
// child exits, so the children die with the soak (also on kill -9 of it).
func spawner() {
	runtime.LockOSThread()
	for r := range spawnCh {
		r.done <- r.cmd.Start()
	}
}

// startChild starts name with args, its output in workDir/logName, and
// returns a channel closed when it exits.
func startChild(logName, name string, args ...string) (*exec.Cmd, chan struct{}, error) {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Dir = workDir
	cmd.Env = append(os.Environ(), "HOME="+workDir, "XDG_DATA_HOME="+workDir, "XDG_CONFIG_HOME="+workDir)
	f, err := os.OpenFile(filepath.Join(workDir, logName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, nil, err
	}
	cmd.Stdout, cmd.Stderr = f, f
	req := spawnReq{cmd: cmd, done: make(chan error, 1)}
	spawnCh <- req
	if err := <-req.done; err != nil {
		f.Close()
		return nil, nil, err
	}
	childMu.Lock()
	children[cmd] = struct{}{}
	childMu.Unlock()
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		f.Close()
		childMu.Lock()
		delete(children, cmd)
		childMu.Unlock()
		close(exited)
	}()
	return cmd, exited, nil
}

// killAll kills every child still running (a paused one is resumed first,
// so that it can die).
func killAll() {
	childMu.Lock()
	defer childMu.Unlock()
	for c := range children {
		c.Process.Signal(syscall.SIGCONT)
		c.Process.Kill()
	}
}

func freePort() (int, error) { return proc.FreePort() }

func tail(logName string, n int) string { return proc.Tail(filepath.Join(workDir, logName), n) }

// ---- redis-server ---------------------------------------------------------------

type redisProc struct {
	name   string
	port   int
	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
}

func (r *redisProc) addr() string { return fmt.Sprintf("127.0.0.1:%d", r.port) }

func newRedis(name string) (*redisProc, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	r := &redisProc{name: name, port: port}
	return r, r.start()
}

// start runs redis-server on r's port, empty and without persistence, and
// waits until it answers PING.
func (r *redisProc) start() error {
	cmd, exited, err := startChild(r.name+".log", *redisBin, "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", workDir, "--dbfilename", r.name+".rdb")
	if err != nil {
		return fmt.Errorf("starting %s: %w", r.name, err)
	}
	r.mu.Lock()
	r.cmd, r.exited = cmd, exited
	r.mu.Unlock()
	c := redis.NewClient(&redis.Options{Addr: r.addr(), MaxRetries: -1})
	defer c.Close()
	for deadline := time.Now().Add(5 * time.Second); ; {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		} else if time.Now().After(deadline) {
			return fmt.Errorf("%s on %s did not answer: %v\n%s", r.name, r.addr(), err, tail(r.name+".log", 5))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *redisProc) signal(s syscall.Signal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cmd.Process.Signal(s)
}

// kill9 kills the server and waits until it is gone.
func (r *redisProc) kill9() {
	r.mu.Lock()
	cmd, exited := r.cmd, r.exited
	r.mu.Unlock()
	cmd.Process.Signal(syscall.SIGCONT)
	cmd.Process.Kill()
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
	}
}

// ---- Caddy ----------------------------------------------------------------------

type caddyProc struct {
	idx       int
	port      int // the site
	adminPort int
	variant   int // which of the equivalent configs runs (see caddyfile)
	mu        sync.Mutex
	cmd       *exec.Cmd
	exited    chan struct{}
}

func (c *caddyProc) name() string              { return fmt.Sprintf("caddy%d", c.idx) }
func (c *caddyProc) url() string               { return fmt.Sprintf("http://127.0.0.1:%d", c.port) }
func (c *caddyProc) adminURL() string          { return fmt.Sprintf("http://127.0.0.1:%d", c.adminPort) }
func (c *caddyProc) cfgPath() string           { return filepath.Join(workDir, c.name()+".Caddyfile") }
func (c *caddyProc) logName() string           { return c.name() + ".log" }
func (c *caddyProc) exitedCh() <-chan struct{} { c.mu.Lock(); defer c.mu.Unlock(); return c.exited }

// start writes the instance's Caddyfile and runs Caddy until its site and
// admin ports accept connections.
func (c *caddyProc) start(s *soak) error {
	if err := os.WriteFile(c.cfgPath(), []byte(s.caddyfile(c, c.variant)), 0o644); err != nil {
		return err
	}
	cmd, exited, err := startChild(c.logName(), *caddyBin, "run", "--config", c.cfgPath(), "--adapter", "caddyfile")
	if err != nil {
		return fmt.Errorf("starting %s: %w", c.name(), err)
	}
	c.mu.Lock()
	c.cmd, c.exited = cmd, exited
	c.mu.Unlock()
	for _, p := range []int{c.port, c.adminPort} {
		for deadline := time.Now().Add(20 * time.Second); ; {
			conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", p), 200*time.Millisecond)
			if err == nil {
				conn.Close()
				break
			}
			select {
			case <-exited:
				return fmt.Errorf("%s exited: %s", c.name(), tail(c.logName(), 3))
			default:
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: port %d not listening after 20s: %s", c.name(), p, tail(c.logName(), 3))
			}
			time.Sleep(30 * time.Millisecond)
		}
	}
	return nil
}

func (c *caddyProc) kill9() {
	c.mu.Lock()
	cmd, exited := c.cmd, c.exited
	c.mu.Unlock()
	cmd.Process.Kill()
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
	}
}

// reload POSTs the instance's config with the given variant to /load.
func (c *caddyProc) reload(s *soak, variant int) error {
	cfg := s.caddyfile(c, variant)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.adminURL()+"/load", bytes.NewReader([]byte(cfg)))
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s /load: %d %s", c.name(), resp.StatusCode, strings.TrimSpace(string(b)))
	}
	c.variant = variant
	return os.WriteFile(c.cfgPath(), []byte(cfg), 0o644) // a later restart runs it
}

// goroutines reads go_goroutines from the admin /metrics endpoint.
func (c *caddyProc) goroutines() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.adminURL()+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "go_goroutines "); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, fmt.Errorf("%s: no go_goroutines in /metrics", c.name())
}

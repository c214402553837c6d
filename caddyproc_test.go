package redisdlm

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	_ "github.com/caddyserver/caddy/v2/modules/standard" // reverse_proxy, handle, ... in the child Caddy
)

// testCaddyEnv, when set to a Caddyfile's path, makes the test binary run
// as Caddy with that config instead of running tests (see TestMain): a
// Caddy of its own OS process, with this plugin and Caddy's standard
// modules linked in, that a test can SIGSTOP or kill, without xcaddy.
const testCaddyEnv = "REDISDLM_TEST_CADDY"

// runAsTestCaddy runs `caddy run --config $REDISDLM_TEST_CADDY`; it never
// returns.
func runAsTestCaddy() {
	os.Args = []string{"caddy", "run", "--config", os.Getenv(testCaddyEnv), "--adapter", "caddyfile"}
	caddycmd.Main()
	os.Exit(0)
}

// caddyProcess is the test binary re-executed as Caddy (runAsTestCaddy),
// killed when its test ends and whenever the test binary dies.
type caddyProcess struct {
	name   string
	cmd    *exec.Cmd
	port   int // the site's port, http://127.0.0.1:port
	log    string
	exited chan struct{}
}

func (c *caddyProcess) url() string { return fmt.Sprintf("http://127.0.0.1:%d", c.port) }

// startCaddyProcess writes caddyfile, which must serve the site on port
// (and may use dir for storage), and starts a Caddy process with it. It
// returns once the site's port accepts connections.
func startCaddyProcess(t *testing.T, name string, port int, caddyfile func(dir string) string) *caddyProcess {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("the test binary: %v", err)
	}
	dir := t.TempDir()
	cfg := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cfg, []byte(caddyfile(dir)), 0o644); err != nil {
		t.Fatal(err)
	}
	c := &caddyProcess{name: name, port: port, log: filepath.Join(dir, "caddy.log"), exited: make(chan struct{})}
	logf, err := os.Create(c.log)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	c.cmd = exec.Command(exe)
	c.cmd.Dir = dir
	c.cmd.Env = append(os.Environ(), testCaddyEnv+"="+cfg, "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("starting Caddy %s: %v", name, err)
	}
	go func() { _ = c.cmd.Wait(); close(c.exited) }()
	t.Cleanup(func() {
		_ = c.cmd.Process.Signal(syscall.SIGCONT) // a stopped process dies only once resumed
		_ = c.cmd.Process.Kill()
		select {
		case <-c.exited:
		case <-time.After(10 * time.Second):
			t.Errorf("Caddy %s (pid %d) did not exit after SIGKILL", name, c.cmd.Process.Pid)
		}
		if t.Failed() {
			b, _ := os.ReadFile(c.log)
			if len(b) > 6000 {
				b = b[len(b)-6000:]
			}
			t.Logf("log of Caddy %s:\n%s", name, b)
		}
	})
	// Bounded: a race-instrumented Caddy on a loaded 2-core machine can
	// take several seconds to start.
	for deadline := time.Now().Add(60 * time.Second); ; {
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 200*time.Millisecond)
		if err == nil {
			conn.Close()
			return c
		}
		select {
		case <-c.exited:
			b, _ := os.ReadFile(c.log)
			t.Fatalf("Caddy %s exited at start:\n%s", name, b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("Caddy %s: port %d not listening after 60s", name, port)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// signal sends sig to the Caddy process.
func (c *caddyProcess) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("%v to Caddy %s: %v", sig, c.name, err)
	}
}

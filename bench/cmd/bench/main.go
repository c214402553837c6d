// Command bench measures redisdlm's redis_lock against its goals
// and against go-redsync/redsync and bsm/redislock, and prints a Markdown
// table.
//
// It starts everything it needs on loopback ports and stops it again:
// redis-server processes, Caddy processes built from this repository
// (bin/caddy, see `make caddy`), and an upstream inside this process that
// measures itself: it records when each request entered and left, checks
// that at most one request per key is inside, and that fencing tokens
// strictly increase.
//
//	go run ./cmd/bench -caddy ../bin/caddy
package main

import (
	"bufio"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-dlm/redisdlm/bench/internal/proc"

	"github.com/bsm/redislock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"
)

// pingRow names the latency row of one plain Redis PING.
const pingRow = "one Redis PING (go-redis, one connection)"

var (
	caddyBin  = flag.String("caddy", "../bin/caddy", "Caddy binary with the redisdlm plugin")
	ceilBin   = flag.String("caddy-ceiling", "../bin/caddy-ceiling", "Caddy binary with bench/benchmutex (the hot-key ceiling row; see `make bin/caddy-ceiling`)")
	redisBin  = flag.String("redis-server", "redis-server", "redis-server binary")
	warmup    = flag.Duration("warmup", time.Second, "hot-key warm-up, not measured")
	measure   = flag.Duration("measure", 5*time.Second, "hot-key measured run")
	hold      = flag.Duration("hold", 2*time.Millisecond, "upstream service time (sleep)")
	clients   = flag.Int("clients", 32, "concurrent clients on the hot key")
	seqN      = flag.Int("n", 500, "sequential requests per latency / command-count run")
	libPause  = flag.Duration("pause", time.Millisecond, "library-level workers: pause after release")
	monitorRn = flag.Duration("monitor", 2*time.Second, "contended run under MONITOR")
	onlyRL    = flag.Bool("only-ratelimit", false, "run the redis_ratelimit part only")
	onlyRP    = flag.Bool("only-replay", false, "run the execute-once (replay) part only")
	onlyRLP   = flag.Bool("only-redlock-proxy", false, "run the Redlock latency-proxy figure only")
	scriptDir = flag.String("scripts", "..", "the plugin's source tree, whose Lua scripts (internal/*/scripts, */scripts) name EVALSHA calls")
)

// scriptNames maps the SHA1 of each of the plugin's scripts to its name.
var scriptNames = map[string]string{}

// refResult is the no-lock, one-client hand-off reference.
var refResult hotResult

// loadAvg is /proc/loadavg when the run started (other work on the machine).
var loadAvg []byte

func loadScriptNames() {
	files, _ := filepath.Glob(filepath.Join(*scriptDir, "*", "scripts", "*.lua"))
	engines, _ := filepath.Glob(filepath.Join(*scriptDir, "internal", "*", "scripts", "*.lua"))
	for _, f := range append(files, engines...) {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		sum := sha1.Sum(b)
		scriptNames[hex.EncodeToString(sum[:])] = strings.TrimSuffix(filepath.Base(f), ".lua")
	}
}

func main() {
	// Children get Pdeathsig, which fires when the *thread* that started
	// them exits: start them all from the main goroutine, locked to the
	// main thread, which lives as long as the process.
	runtime.LockOSThread()
	flag.Parse()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		s := <-sig
		fmt.Fprintf(os.Stderr, "bench: %v: stopping children\n", s)
		killAll()
		os.Exit(130)
	}()
	code := 0
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		code = 1
	}
	killAll()
	os.Exit(code)
}

// ---- child processes --------------------------------------------------------

var (
	childMu  sync.Mutex
	children []*exec.Cmd
	exitedCh = map[*exec.Cmd]chan struct{}{}
	workDir  string
)

func startChild(logName, name string, args ...string) (*exec.Cmd, error) {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Dir = workDir
	cmd.Env = append(os.Environ(), "HOME="+workDir, "XDG_DATA_HOME="+workDir, "XDG_CONFIG_HOME="+workDir)
	f, err := os.Create(filepath.Join(workDir, logName))
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = f, f
	childMu.Lock()
	defer childMu.Unlock()
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	children = append(children, cmd)
	done := make(chan struct{})
	exitedCh[cmd] = done
	go func() { cmd.Wait(); f.Close(); close(done) }()
	return cmd, nil
}

func killAll() {
	childMu.Lock()
	defer childMu.Unlock()
	for _, c := range children {
		if c.Process != nil {
			c.Process.Signal(syscall.SIGCONT) // a paused redis must be able to die
			c.Process.Kill()
		}
	}
	children = nil
	if workDir != "" && os.Getenv("BENCH_KEEP") == "" {
		os.RemoveAll(workDir)
	}
}

func freePort() (int, error) { return proc.FreePort() }

func tail(logName string, n int) string { return proc.Tail(filepath.Join(workDir, logName), n) }

type redisProc struct {
	port int
	cmd  *exec.Cmd
}

func (r *redisProc) addr() string { return fmt.Sprintf("127.0.0.1:%d", r.port) }

func startRedis(name string) (*redisProc, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	cmd, err := startChild(name+".log", *redisBin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", workDir, "--dbfilename", name+".rdb")
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	r := &redisProc{port: port, cmd: cmd}
	c := redis.NewClient(&redis.Options{Addr: r.addr()})
	defer c.Close()
	for deadline := time.Now().Add(5 * time.Second); ; {
		if err := c.Ping(context.Background()).Err(); err == nil {
			return r, nil
		} else if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s on %s did not answer: %v\n%s", name, r.addr(), err, tail(name+".log", 5))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type caddyProc struct {
	name string
	cmd  *exec.Cmd
}

// startCaddy runs bin/caddy with a Caddyfile and waits until every port
// accepts connections; on failure the error carries the log's tail.
func startCaddy(name, caddyfile string, ports ...int) (*caddyProc, error) {
	return startCaddyBin(*caddyBin, name, caddyfile, ports...)
}

// startCaddyBin is startCaddy with another Caddy binary.
func startCaddyBin(bin, name, caddyfile string, ports ...int) (*caddyProc, error) {
	path := filepath.Join(workDir, name+".Caddyfile")
	if err := os.WriteFile(path, []byte(caddyfile), 0o644); err != nil {
		return nil, err
	}
	cmd, err := startChild(name+".log", bin, "run", "--config", path, "--adapter", "caddyfile")
	if err != nil {
		return nil, fmt.Errorf("starting caddy %s: %w", name, err)
	}
	childMu.Lock()
	exited := exitedCh[cmd]
	childMu.Unlock()
	for _, p := range ports {
		for deadline := time.Now().Add(15 * time.Second); ; {
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", p), 200*time.Millisecond)
			if err == nil {
				c.Close()
				break
			}
			select {
			case <-exited:
				return nil, fmt.Errorf("caddy %s exited: %s", name, lastError(name+".log"))
			default:
			}
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("caddy %s: port %d not listening after 15s: %s", name, p, lastError(name+".log"))
			}
			time.Sleep(30 * time.Millisecond)
		}
	}
	return &caddyProc{name: name, cmd: cmd}, nil
}

// lastError returns the most telling line of a Caddy log.
func lastError(logName string) string {
	t := tail(logName, 20)
	lines := strings.Split(t, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], "rror") {
			return strings.TrimSpace(lines[i])
		}
	}
	if len(lines) > 0 {
		return strings.TrimSpace(lines[len(lines)-1])
	}
	return "(no log)"
}

// ---- the upstream -------------------------------------------------------------

// rec is one request as the upstream saw it.
type rec struct {
	entry, exit time.Time
	client      string
	inst        string
	fence       int64
}

type scenario struct {
	inflight   int
	maxIn      int
	overlap    int // requests that entered while another was inside
	lastFence  int64
	fenceBad   int // tokens not strictly above the previous one
	fenceSeen  int
	recs       []rec
	lateExit   int
	recordable bool
}

type upstream struct {
	mu   sync.Mutex
	scen map[string]*scenario
	url  string
	srv  *http.Server
}

func startUpstream() (*upstream, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	u := &upstream{scen: map[string]*scenario{}, url: "http://" + l.Addr().String()}
	u.srv = &http.Server{Handler: u, ReadHeaderTimeout: 10 * time.Second}
	go u.srv.Serve(l)
	return u, nil
}

func (u *upstream) get(name string) *scenario {
	s := u.scen[name]
	if s == nil {
		s = &scenario{lastFence: -1}
		u.scen[name] = s
	}
	return s
}

// ServeHTTP: /fast/... answers at once; /hot-<name>... sleeps -hold and is
// recorded under <name>.
func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, "/fast") {
		io.WriteString(w, "ok")
		return
	}
	entry := time.Now()
	name := strings.TrimPrefix(r.URL.Path, "/")
	fence := int64(-1)
	if v := r.Header.Get("Lock-Fencing-Token"); v != "" {
		fence, _ = strconv.ParseInt(v, 10, 64)
	}
	u.mu.Lock()
	s := u.get(name)
	s.inflight++
	if s.inflight > 1 {
		s.overlap++
	}
	if s.inflight > s.maxIn {
		s.maxIn = s.inflight
	}
	if fence >= 0 {
		s.fenceSeen++
		if fence <= s.lastFence {
			s.fenceBad++
		}
		s.lastFence = fence
	}
	u.mu.Unlock()

	time.Sleep(*hold)

	exit := time.Now() // right before the response is written
	u.mu.Lock()
	s.inflight--
	s.recs = append(s.recs, rec{entry: entry, exit: exit, client: r.Header.Get("X-Client"), inst: r.Header.Get("X-Instance"), fence: fence})
	u.mu.Unlock()
	io.WriteString(w, "ok")
}

func (u *upstream) take(name string) scenario {
	u.mu.Lock()
	defer u.mu.Unlock()
	s := u.get(name)
	out := *s
	out.recs = append([]rec(nil), s.recs...)
	return out
}

// ---- HTTP clients -------------------------------------------------------------

var transport = &http.Transport{
	Proxy:               nil,
	DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
	MaxIdleConns:        512,
	MaxIdleConnsPerHost: 128,
	IdleConnTimeout:     90 * time.Second,
	DisableCompression:  true,
}

var httpClient = &http.Client{Transport: transport, Timeout: 15 * time.Second}

func get(ctx context.Context, url string, hdr map[string]string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// errCount counts non-200 outcomes by kind.
type errCount struct {
	mu sync.Mutex
	m  map[string]int
}

func (e *errCount) add(k string) {
	e.mu.Lock()
	if e.m == nil {
		e.m = map[string]int{}
	}
	e.m[k]++
	e.mu.Unlock()
}

func (e *errCount) String() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.m) == 0 {
		return "0"
	}
	var parts []string
	for k, v := range e.m {
		parts = append(parts, fmt.Sprintf("%d× %s", v, strings.ReplaceAll(k, "|", "/")))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// target is one Caddy site that clients hammer.
type target struct {
	url     string
	clients int
	prefix  string // client id prefix
}

// hotHTTP runs the HTTP clients until stop: request → response → next.
// It returns the client ids and the errors seen.
func hotHTTP(targets []target, stop time.Time) ([]string, *errCount) {
	var ids []string
	errs := &errCount{}
	ctx, cancel := context.WithDeadline(context.Background(), stop.Add(3*time.Second))
	defer cancel()
	var wg sync.WaitGroup
	for _, t := range targets {
		for i := 0; i < t.clients; i++ {
			id := fmt.Sprintf("%s%02d", t.prefix, i)
			ids = append(ids, id)
			wg.Add(1)
			go func(url, id string) {
				defer wg.Done()
				hdr := map[string]string{"X-Client": id}
				for time.Now().Before(stop) {
					code, err := get(ctx, url, hdr)
					switch {
					case err != nil:
						if ctx.Err() == nil {
							errs.add("transport error")
							time.Sleep(10 * time.Millisecond)
						}
					case code != 200:
						errs.add(strconv.Itoa(code))
					}
				}
			}(t.url, id)
		}
	}
	wg.Wait()
	return ids, errs
}

// ---- analysis -----------------------------------------------------------------

type hotResult struct {
	name        string
	who         string
	clients     string
	util        float64
	served      float64
	n           int
	minC, maxC  int
	starved     int
	gapAll      []time.Duration
	gapSame     []time.Duration
	gapAcross   []time.Duration
	errs        string
	overlap     int
	fenceBad    int
	fenceSeen   int
	goal        float64
	note        string
	perInstance map[string]int
	err         error
}

func analyse(name string, s scenario, ids []string, from, to time.Time) hotResult {
	r := hotResult{name: name, overlap: s.overlap, fenceBad: s.fenceBad, fenceSeen: s.fenceSeen, perInstance: map[string]int{}}
	var in []rec
	for _, x := range s.recs {
		if !x.entry.Before(from) && x.entry.Before(to) {
			in = append(in, x)
		}
	}
	sort.Slice(in, func(i, j int) bool { return in[i].entry.Before(in[j].entry) })
	r.n = len(in)
	if len(in) == 0 {
		r.err = errors.New("no request reached the upstream")
		return r
	}
	var busy time.Duration
	first, last := in[0].entry, in[0].exit
	per := map[string]int{}
	for _, id := range ids {
		per[id] = 0
	}
	for i, x := range in {
		busy += x.exit.Sub(x.entry)
		if x.exit.After(last) {
			last = x.exit
		}
		per[x.client]++
		r.perInstance[x.inst]++
		if i > 0 {
			g := x.entry.Sub(in[i-1].exit)
			r.gapAll = append(r.gapAll, g)
			if x.inst == in[i-1].inst {
				r.gapSame = append(r.gapSame, g)
			} else {
				r.gapAcross = append(r.gapAcross, g)
			}
		}
	}
	wall := last.Sub(first)
	r.util = float64(busy) / float64(wall)
	r.served = float64(len(in)) / wall.Seconds()
	r.minC, r.maxC = -1, 0
	for _, c := range per {
		if r.minC < 0 || c < r.minC {
			r.minC = c
		}
		if c > r.maxC {
			r.maxC = c
		}
		if c == 0 {
			r.starved++
		}
	}
	return r
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p * float64(len(s)-1))
	return s[i]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/1e6) }

// ---- MONITOR ------------------------------------------------------------------

// monitor counts the top-level commands a Redis server receives (MONITOR
// lines from a script, marked "lua", are left out), by command name.
type monitor struct {
	conn  net.Conn
	mu    sync.Mutex
	count map[string]int
	done  chan struct{}
}

func startMonitor(addr string) (*monitor, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	if _, err := io.WriteString(c, "MONITOR\r\n"); err != nil {
		c.Close()
		return nil, err
	}
	br := bufio.NewReaderSize(c, 1<<16)
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "+OK") {
		c.Close()
		return nil, fmt.Errorf("MONITOR: %q %v", line, err)
	}
	m := &monitor{conn: c, count: map[string]int{}, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			i := strings.Index(line, "] \"")
			if i < 0 || strings.Contains(line[:i], " lua") {
				continue
			}
			rest := line[i+3:]
			j := strings.IndexByte(rest, '"')
			if j < 0 {
				continue
			}
			name := strings.ToUpper(rest[:j])
			if name == "EVALSHA" {
				// Name the script: the next quoted token is its SHA1.
				arg := strings.TrimPrefix(rest[j+1:], " \"")
				if k := strings.IndexByte(arg, '"'); k > 0 {
					if n, ok := scriptNames[arg[:k]]; ok {
						name += " " + n
					}
				}
			}
			m.mu.Lock()
			m.count[name]++
			m.mu.Unlock()
		}
	}()
	return m, nil
}

// snapshot returns the commands counted so far.
func (m *monitor) snapshot() (int, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	total := 0
	for _, v := range m.count {
		total += v
	}
	return total, ""
}

// stop waits a moment for late lines, closes, and returns the counts.
// connSetup are the commands a new connection sends once (the handshake
// and the plugin's server check): shown, but not counted per request.
var connSetup = map[string]bool{"HELLO": true, "AUTH": true, "CLIENT": true, "INFO": true, "SELECT": true}

func (m *monitor) stop() (int, string) {
	time.Sleep(200 * time.Millisecond)
	m.conn.Close()
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	total := 0
	type kv struct {
		k string
		v int
	}
	var kvs []kv
	for k, v := range m.count {
		if !connSetup[strings.Fields(k)[0]] {
			total += v
		}
		kvs = append(kvs, kv{k, v})
	}
	sort.Slice(kvs, func(i, j int) bool { return kvs[i].v > kvs[j].v || kvs[i].v == kvs[j].v && kvs[i].k < kvs[j].k })
	var parts []string
	for _, x := range kvs {
		parts = append(parts, fmt.Sprintf("%s %d", x.k, x.v))
	}
	return total, strings.Join(parts, ", ")
}

// ---- sequential latency -------------------------------------------------------

type seqResult struct {
	name   string
	sent   int // requests sent, warm-up included
	n      int
	median time.Duration
	p99    time.Duration
	errs   *errCount
	err    error
}

// sequential sends up to n requests one after another on distinct paths
// (so distinct lock keys), for at most budget; 10 unmeasured first.
func sequential(name, base string, n int, budget time.Duration) seqResult {
	r := seqResult{name: name, errs: &errCount{}}
	ctx := context.Background()
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	for i := 0; i < 10; i++ {
		get(ctx, fmt.Sprintf("%s/fast/warm-%s-%d", base, tag, i), nil)
		r.sent++
	}
	var lat []time.Duration
	end := time.Now().Add(budget)
	for i := 0; i < n && time.Now().Before(end); i++ {
		t := time.Now()
		code, err := get(ctx, fmt.Sprintf("%s/fast/%s-%d", base, tag, i), nil)
		d := time.Since(t)
		r.sent++
		switch {
		case err != nil:
			r.errs.add("transport error")
			continue
		case code != 200:
			r.errs.add(strconv.Itoa(code))
			continue
		}
		lat = append(lat, d)
	}
	r.n = len(lat)
	if r.n == 0 {
		r.err = fmt.Errorf("no successful request (%s)", r.errs)
		return r
	}
	r.median, r.p99 = pct(lat, 0.5), pct(lat, 0.99)
	return r
}

// latTarget is one configuration of the latency rows: an HTTP base URL,
// or do (a direct call, e.g. one Redis PING).
type latTarget struct {
	name, base string
	do         func(ctx context.Context) error
	// spacer: sent in the rounds but not measured (see spaced).
	spacer bool
}

// spaced puts a spacer, one request to base (a `respond`-only route),
// before each of ts: every measured call then follows the same kind of
// call, and none overlaps the background work of the call before it. A
// locked request's release goes to Redis in the background right as its
// answer leaves, and on a machine of two cores it competes with the call
// sent next: a PING right after a Redlock request measured 10–25 % slower,
// which flattered the lock's ratio to it.
func spaced(base string, ts ...latTarget) []latTarget {
	var out []latTarget
	for _, t := range ts {
		out = append(out, latTarget{name: "spacer", base: base, spacer: true}, t)
	}
	return out
}

// seqNamed is the result of the target called name (the zero result, with
// an error, when there is none).
func seqNamed(seq []seqResult, name string) seqResult {
	for _, s := range seq {
		if s.name == name {
			return s
		}
	}
	return seqResult{name: name, err: fmt.Errorf("not measured"), errs: &errCount{}}
}

// interleaved sends n requests to each target, one target after another
// (round-robin), on distinct paths, for at most budget in all. It returns
// the measured targets in their order (spacers left out).
func interleaved(ts []latTarget, n int, budget time.Duration) []seqResult {
	ctx := context.Background()
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	res := make([]seqResult, len(ts))
	lat := make([][]time.Duration, len(ts))
	for i, t := range ts {
		res[i] = seqResult{name: t.name, errs: &errCount{}}
	}
	end := time.Now().Add(budget)
	for k := 0; k < n && time.Now().Before(end); k++ {
		for i, t := range ts {
			start := time.Now()
			code, err := 200, error(nil)
			if t.do != nil {
				err = t.do(ctx)
			} else {
				code, err = get(ctx, fmt.Sprintf("%s/fast/il-%s-%d", t.base, tag, k), nil)
			}
			d := time.Since(start)
			res[i].sent++
			switch {
			case err != nil:
				res[i].errs.add("transport error")
			case code != 200:
				res[i].errs.add(strconv.Itoa(code))
			default:
				lat[i] = append(lat[i], d)
			}
		}
	}
	var out []seqResult
	for i := range res {
		if ts[i].spacer {
			continue
		}
		res[i].n = len(lat[i])
		if res[i].n == 0 {
			res[i].err = fmt.Errorf("no successful request (%s)", res[i].errs)
		} else {
			res[i].median, res[i].p99 = pct(lat[i], 0.5), pct(lat[i], 0.99)
		}
		out = append(out, res[i])
	}
	return out
}

// ---- library-level contenders -------------------------------------------------

type lockFunc func(ctx context.Context) (unlock func(), err error)

// hotLib runs workers in this process: acquire → GET the upstream (the
// same 2 ms handler) → release → pause.
func hotLib(u *upstream, name string, workers int, stop time.Time, newLock func() lockFunc) ([]string, *errCount) {
	var ids []string
	errs := &errCount{}
	ctx, cancel := context.WithDeadline(context.Background(), stop)
	defer cancel()
	var wg sync.WaitGroup
	for i := 0; i < workers; i++ {
		id := fmt.Sprintf("w%02d", i)
		ids = append(ids, id)
		wg.Add(1)
		go func(id string) {
			defer wg.Done()
			lock := newLock()
			hdr := map[string]string{"X-Client": id, "X-Instance": "lib"}
			for time.Now().Before(stop) {
				unlock, err := lock(ctx)
				if err != nil {
					if ctx.Err() == nil {
						errs.add("acquire: " + shortErr(err))
					}
					continue
				}
				if _, err := get(context.Background(), u.url+"/"+name, hdr); err != nil {
					errs.add("upstream error")
				}
				unlock()
				time.Sleep(*libPause)
			}
		}(id)
	}
	wg.Wait()
	return ids, errs
}

func shortErr(err error) string {
	s := err.Error()
	if len(s) > 40 {
		s = s[:40] + "…"
	}
	return s
}

// cmdRow is one line of the commands-per-request table.
type cmdRow struct {
	what, unit string
	reqs       int
	cmds       int
	breakdown  string
	goal       float64
	zeroGoal   bool // goal is exactly 0 commands
	err        error
}

// ---- the run ------------------------------------------------------------------

type env struct {
	r1, r3a, r3b, r3c *redisProc
	up                *upstream
	portsA            struct{ hot, lock1, base, proxy int }
	portB, portC      int
	caddyA, caddyB    *caddyProc
	caddyC            *caddyProc
	caddyCErr         error
	portCeil          int
	caddyCeil         *caddyProc // bin/caddy-ceiling: bench_mutex instead of redis_lock
	caddyCeilErr      error
}

func globalOpts(name string) string {
	return fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	default_bind 127.0.0.1
	storage file_system %s
	log {
		level ERROR
	}
}
`, filepath.Join(workDir, "data-"+name))
}

func hotSite(port int, redisAddrs, instance, upstreamURL string) string {
	return fmt.Sprintf(`
http://127.0.0.1:%d {
	redis_lock {
		key {http.request.uri.path}
		redis %s
	}
	request_header X-Instance %s
	reverse_proxy %s
}
`, port, redisAddrs, instance, strings.TrimPrefix(upstreamURL, "http://"))
}

// ceilingSite is hotSite with bench_mutex (bench/benchmutex: one
// process-wide sync.Mutex, increasing Lock-Fencing-Token) instead of
// redis_lock: the ceiling of the hot-key row through Caddy.
func ceilingSite(port int, instance, upstreamURL string) string {
	return fmt.Sprintf(`
http://127.0.0.1:%d {
	bench_mutex
	request_header X-Instance %s
	reverse_proxy %s
}
`, port, instance, strings.TrimPrefix(upstreamURL, "http://"))
}

func lockRespondSite(port int, redisAddrs string) string {
	return fmt.Sprintf(`
http://127.0.0.1:%d {
	redis_lock {
		key {http.request.uri.path}
		redis %s
	}
	respond "ok" 200
}
`, port, redisAddrs)
}

func proxySite(port int, instance, upstreamURL string) string {
	return fmt.Sprintf(`
http://127.0.0.1:%d {
	request_header X-Instance %s
	reverse_proxy %s
}
`, port, instance, strings.TrimPrefix(upstreamURL, "http://"))
}

func respondSite(port int) string {
	return fmt.Sprintf(`
http://127.0.0.1:%d {
	respond "ok" 200
}
`, port)
}

func run() error {
	var err error
	workDir, err = os.MkdirTemp("", "redisdlm-bench-")
	if err != nil {
		return err
	}
	loadAvg, _ = os.ReadFile("/proc/loadavg")
	loadScriptNames()
	if abs, err := filepath.Abs(*caddyBin); err == nil {
		*caddyBin = abs
	}
	if _, err := os.Stat(*caddyBin); err != nil {
		return fmt.Errorf("caddy binary: %w (run `make caddy`)", err)
	}
	if abs, err := filepath.Abs(*ceilBin); err == nil {
		*ceilBin = abs
	}
	begin := time.Now()
	e := &env{}
	step := func(f string, a ...any) {
		fmt.Fprintf(os.Stderr, "[%5.1fs] "+f+"\n", append([]any{time.Since(begin).Seconds()}, a...)...)
	}

	if *onlyRP { // the execute-once figure alone
		printReplay(func(f string, a ...any) { fmt.Printf(f+"\n", a...) }, runReplay(step, 50))
		return nil
	}
	if *onlyRLP { // the Redlock latency-proxy figure alone
		printRedlockProxy(func(f string, a ...any) { fmt.Printf(f+"\n", a...) }, runRedlockProxy(step, *seqN))
		return nil
	}
	if *onlyCost { // the cost goals alone: lock cost and rate-limit cost, same-run ratios
		printCostGoals(func(f string, a ...any) { fmt.Printf(f+"\n", a...) }, runCostGoals(step, nil, nil))
		return nil
	}
	if *onlyRL { // development: the rate-limit part alone
		rl := runRateLimit(step)
		printRateLimit(func(f string, a ...any) { fmt.Printf(f+"\n", a...) }, rl)
		return nil
	}

	step("starting redis-server ×4, upstream, caddy ×3 + ceiling (work dir %s)", workDir)
	for _, p := range []struct {
		dst  **redisProc
		name string
	}{{&e.r1, "redis1"}, {&e.r3a, "redis3a"}, {&e.r3b, "redis3b"}, {&e.r3c, "redis3c"}} {
		if *p.dst, err = startRedis(p.name); err != nil {
			return err
		}
	}
	if e.up, err = startUpstream(); err != nil {
		return err
	}
	defer e.up.srv.Close()
	ports := make([]int, 7)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return err
		}
	}
	e.portsA.hot, e.portsA.lock1, e.portsA.base, e.portB, e.portC, e.portsA.proxy = ports[0], ports[1], ports[2], ports[3], ports[4], ports[5]
	e.portCeil = ports[6]
	cfA := globalOpts("a") + hotSite(e.portsA.hot, e.r1.addr(), "a", e.up.url) +
		lockRespondSite(e.portsA.lock1, e.r1.addr()) + respondSite(e.portsA.base) + proxySite(e.portsA.proxy, "a", e.up.url)
	if e.caddyA, err = startCaddy("caddyA", cfA, e.portsA.hot, e.portsA.lock1, e.portsA.base, e.portsA.proxy); err != nil {
		return err
	}
	cfB := globalOpts("b") + hotSite(e.portB, e.r1.addr(), "b", e.up.url)
	if e.caddyB, err = startCaddy("caddyB", cfB, e.portB); err != nil {
		return err
	}
	// Redlock in its own process, so that a failure there spoils one row only.
	cfC := globalOpts("c") + lockRespondSite(e.portC, strings.Join([]string{e.r3a.addr(), e.r3b.addr(), e.r3c.addr()}, " "))
	e.caddyC, e.caddyCErr = startCaddy("caddyC", cfC, e.portC)
	// The ceiling: stock Caddy + bench_mutex, its own process, so that a
	// missing bin/caddy-ceiling spoils one row only.
	if _, err := os.Stat(*ceilBin); err != nil {
		e.caddyCeilErr = fmt.Errorf("ceiling binary: %w (run `make bin/caddy-ceiling`)", err)
	} else {
		e.caddyCeil, e.caddyCeilErr = startCaddyBin(*ceilBin, "caddyCeil", globalOpts("ceil")+ceilingSite(e.portCeil, "a", e.up.url), e.portCeil)
	}

	urlA := fmt.Sprintf("http://127.0.0.1:%d", e.portsA.hot)
	urlB := fmt.Sprintf("http://127.0.0.1:%d", e.portB)

	// 1+2. Hot key through Caddy.
	var hot []hotResult
	runHot := func(name, who, cl string, goal float64, targets []target) hotResult {
		step("hot key: %s (%s warm-up + %s)", who, *warmup, *measure)
		for i := range targets {
			targets[i].url += "/" + name
		}
		t0 := time.Now()
		from, stop := t0.Add(*warmup), t0.Add(*warmup+*measure)
		ids, errs := hotHTTP(targets, stop)
		r := analyse(name, e.up.take(name), ids, from, stop)
		r.who, r.clients, r.goal, r.errs = who, cl, goal, errs.String()
		return r
	}
	half := *clients / 2
	hot = append(hot, runHot("hot-caddy1", "redis_lock, 1 Caddy", fmt.Sprint(*clients), 0.90,
		[]target{{url: urlA, clients: *clients, prefix: "a"}}))
	const ceilWho = "perfect in-process lock through Caddy (ceiling)"
	if e.caddyCeilErr != nil {
		hot = append(hot, hotResult{name: "hot-ceiling", who: ceilWho, clients: fmt.Sprint(*clients), errs: "—", err: e.caddyCeilErr})
	} else {
		hot = append(hot, runHot("hot-ceiling", ceilWho, fmt.Sprint(*clients), 0,
			[]target{{url: fmt.Sprintf("http://127.0.0.1:%d", e.portCeil), clients: *clients, prefix: "a"}}))
	}
	hot = append(hot, runHot("hot-caddy2", "redis_lock, 2 Caddy, 1 Redis", fmt.Sprintf("%d + %d", half, *clients-half), 0.80,
		[]target{{url: urlA, clients: half, prefix: "a"}, {url: urlB, clients: *clients - half, prefix: "b"}}))

	// Reference for the hand-off: one client, no lock, through Caddy; its
	// gap is response → Caddy → client → next request → Caddy → upstream.
	{
		step("reference: one client, no lock, through Caddy (2s)")
		t0 := time.Now()
		ids, errs := hotHTTP([]target{{url: fmt.Sprintf("http://127.0.0.1:%d/hot-ref", e.portsA.proxy), clients: 1, prefix: "r"}}, t0.Add(2*time.Second))
		r := analyse("hot-ref", e.up.take("hot-ref"), ids, t0.Add(200*time.Millisecond), t0.Add(2*time.Second))
		r.who, r.clients, r.errs = "reference: 1 client, no lock, through Caddy", "1", errs.String()
		refResult = r
	}

	// 3. Redis commands per request.
	var cmdRows []cmdRow
	{
		step("commands: %d uncontended requests under MONITOR", *seqN)
		base := fmt.Sprintf("http://127.0.0.1:%d", e.portsA.lock1)
		sequential("warm", base, 20, 5*time.Second) // scripts loaded, pool warm
		m, err := startMonitor(e.r1.addr())
		row := cmdRow{what: "uncontended, 1 server, distinct keys", unit: "request", goal: 2}
		if err != nil {
			row.err = err
		} else {
			sr := sequential("cmds", base, *seqN, 20*time.Second)
			row.cmds, row.breakdown = m.stop()
			row.reqs = sr.sent
			if sr.err != nil {
				row.err = sr.err
			}
		}
		cmdRows = append(cmdRows, row)
	}
	contendedCmds := func(name, what string, targets []target) cmdRow {
		step("commands: %s, %s under MONITOR", what, *monitorRn)
		row := cmdRow{what: what, unit: "acquisition", goal: 0}
		m, err := startMonitor(e.r1.addr())
		if err != nil {
			row.err = err
			return row
		}
		for i := range targets {
			targets[i].url += "/" + name
		}
		hotHTTP(targets, time.Now().Add(*monitorRn))
		time.Sleep(100 * time.Millisecond)
		row.cmds, row.breakdown = m.stop()
		row.reqs = len(e.up.take(name).recs)
		return row
	}
	cmdRows = append(cmdRows, contendedCmds("hot-mon1", fmt.Sprintf("hot key, 1 Caddy, %d clients", *clients),
		[]target{{url: urlA, clients: *clients, prefix: "a"}}))
	cmdRows = append(cmdRows, contendedCmds("hot-mon2", fmt.Sprintf("hot key, 2 Caddy, %d + %d clients", half, *clients-half),
		[]target{{url: urlA, clients: half, prefix: "a"}, {url: urlB, clients: *clients - half, prefix: "b"}}))

	// 4. Lock latency through Caddy: base, one PING (the unit of the
	// uncontended lock's added latency), 1 server, 3 servers, sampled
	// round-robin so that all of them see the same machine load, each
	// after a spacer (see spaced).
	var seq []seqResult
	step("latency: %d sequential requests each, interleaved: respond only, one PING, lock on 1 server, lock on 3 servers", *seqN)
	urlC := fmt.Sprintf("http://127.0.0.1:%d", e.portC)
	urlBase := fmt.Sprintf("http://127.0.0.1:%d", e.portsA.base)
	lat := []latTarget{
		{name: "Caddy, `respond` only (base)", base: urlBase},
		{name: "redis_lock, 1 server", base: fmt.Sprintf("http://127.0.0.1:%d", e.portsA.lock1)},
	}
	const name3, name3p = "redis_lock, 3 servers (Redlock)", "redis_lock, 3 servers, one paused (SIGSTOP)"
	if e.caddyCErr == nil {
		lat = append(lat, latTarget{name: name3, base: urlC})
	}
	for _, t := range lat {
		sequential("warm", t.base, 20, 5*time.Second)
	}
	pinger := redis.NewClient(&redis.Options{Addr: e.r1.addr(), PoolSize: 1})
	defer pinger.Close()
	ping := latTarget{name: pingRow, do: func(ctx context.Context) error { return pinger.Ping(ctx).Err() }}
	rounds := spaced(urlBase, append([]latTarget{lat[0], ping}, lat[1:]...)...)
	var m3 *monitor
	var m3err error
	if e.caddyCErr == nil {
		m3, m3err = startMonitor(e.r3a.addr())
	}
	seq = interleaved(rounds, *seqN, 30*time.Second)
	var redlockCmds cmdRow
	if e.caddyCErr != nil {
		seq = append(seq, seqResult{name: name3, err: e.caddyCErr})
		seq = append(seq, seqResult{name: name3p, err: e.caddyCErr})
		redlockCmds = cmdRow{what: "uncontended, Redlock 3 servers (commands to one of them)", unit: "request", err: e.caddyCErr}
	} else {
		redlockCmds = cmdRow{what: "uncontended, Redlock 3 servers (commands to one of them)", unit: "request", reqs: seqNamed(seq, name3).sent, err: m3err}
		if m3err == nil {
			redlockCmds.cmds, redlockCmds.breakdown = m3.stop()
		}
		step("latency: Redlock with one of three servers paused (at most 8 s)")
		e.r3c.cmd.Process.Signal(syscall.SIGSTOP)
		seq = append(seq, sequential(name3p, urlC, *seqN, 8*time.Second))
		e.r3c.cmd.Process.Signal(syscall.SIGCONT)
	}
	cmdRows = append(cmdRows, redlockCmds)
	step("lock cost: Redis CPU per uncontended locked request, 1 and 3 servers (3 s each)")
	costs := []lockCostRow{runLockCost("redis_lock, 1 server", fmt.Sprintf("http://127.0.0.1:%d", e.portsA.lock1), []*redisProc{e.r1}, *clients, 3*time.Second)}
	if e.caddyCErr == nil {
		costs = append(costs, runLockCost("redis_lock, 3 servers (Redlock)", urlC, []*redisProc{e.r3a, e.r3b, e.r3c}, *clients, 3*time.Second))
	}

	// 5. Peers at library level, same upstream, same worker loop.
	rdb := redis.NewClient(&redis.Options{Addr: e.r1.addr(), PoolSize: 4 * *clients, MinIdleConns: *clients})
	defer rdb.Close()
	runLib := func(name, who string, newLock func() lockFunc) hotResult {
		step("hot key: %s (%s warm-up + %s)", who, *warmup, *measure)
		t0 := time.Now()
		from, stop := t0.Add(*warmup), t0.Add(*warmup+*measure)
		ids, errs := hotLib(e.up, name, *clients, stop, newLock)
		r := analyse(name, e.up.take(name), ids, from, stop)
		r.who, r.clients, r.errs = who, fmt.Sprintf("%d goroutines", *clients), errs.String()
		return r
	}
	rs := redsync.New(goredis.NewPool(rdb))
	hot = append(hot, runLib("hot-redsync", "go-redsync/redsync "+modVersion("github.com/go-redsync/redsync/v4")+
		" — defaults: 32 tries, 50–250 ms random delay, expiry 8 s", func() lockFunc {
		mu := rs.NewMutex("bench:redsync:hot")
		return func(ctx context.Context) (func(), error) {
			if err := mu.LockContext(ctx); err != nil {
				return nil, err
			}
			return func() { mu.UnlockContext(context.Background()) }, nil
		}
	}))
	bl := redislock.New(rdb)
	hot = append(hot, runLib("hot-bsm", "bsm/redislock "+modVersion("github.com/bsm/redislock")+
		" — default is no retry; used ExponentialBackoff(16 ms, 512 ms) (doc: min ≥ 16 ms), ttl 8 s", func() lockFunc {
		return func(ctx context.Context) (func(), error) {
			l, err := bl.Obtain(ctx, "bench:bsm:hot", 8*time.Second, &redislock.Options{
				RetryStrategy: redislock.ExponentialBackoff(16*time.Millisecond, 512*time.Millisecond),
			})
			if err != nil {
				return nil, err
			}
			return func() { l.Release(context.Background()) }, nil
		}
	}))
	var local sync.Mutex
	hot = append(hot, runLib("hot-mutex", "in-process sync.Mutex (ceiling for this loop)", func() lockFunc {
		return func(ctx context.Context) (func(), error) {
			local.Lock()
			return local.Unlock, nil
		}
	}))

	// 6. redis_ratelimit: its own Caddy process and redis-servers.
	rl := runRateLimit(step)
	// 7. Execute once: its own Caddy processes and redis-server.
	rp := runReplay(step, 50)
	// 8. Redlock behind latency proxies: its own Caddy and redis-servers.
	rlp := runRedlockProxy(step, *seqN)
	// 9. The cost goals as same-run ratios: its own Caddy and redis-servers.
	cg := runCostGoals(step, costs, hot)
	step("done; stopping")

	printReport(e, hot, cmdRows, seq, rl, time.Since(begin))
	printf := func(f string, a ...any) { fmt.Printf(f+"\n", a...) }
	printLockCost(printf, costs, *clients)
	printRedlockProxy(printf, rlp)
	printReplay(printf, rp)
	printCostGoals(printf, cg)
	return nil
}

// modVersion reports a dependency's version from the build info.
func modVersion(path string) string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == path {
				return d.Version
			}
		}
	}
	return "?"
}

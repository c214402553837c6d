// Command soak runs redisdlm under random faults against an independent
// checker (README "How we test"), and exits 1 when a promise was broken.
//
// It starts 4 Caddy processes (bin/caddy, see `make caddy`), a single
// Redis and a 3-server Redlock (redis-server processes without
// persistence), a TCP fault proxy between each Caddy and each Redis, and
// the checking upstream, all on loopback ports. Clients keep hot and cold
// lock keys, a `permits 2` route, fenced writes (a redis_fence tier in
// front of the checker as storage), rate-limited keys and a fail_local
// rate limit (faillocal.go) and execute-once orders (once.go) busy while faults,
// drawn from -seed, strike one at a time. Afterwards it checks that nothing
// is still held and that connections and goroutines are back where they
// were, and prints a Markdown summary.
//
//	go run ./cmd/soak -caddy ../bin/caddy -duration 30s [-seed N]
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddy-dlm/redisdlm/bench/internal/faultproxy"
)

var (
	caddyBin       = flag.String("caddy", "../bin/caddy", "Caddy binary with the redisdlm plugin")
	redisBin       = flag.String("redis-server", "redis-server", "redis-server binary")
	duration       = flag.Duration("duration", 5*time.Minute, "length of the fault phase")
	seedFlag       = flag.Int64("seed", 0, "seed of the fault schedule; 0 = a new one (printed)")
	workers        = flag.Int("workers", 16, "clients on the lock routes")
	rlWorkers      = flag.Int("rl-workers", 4, "clients on the rate-limited routes")
	tolerance      = flag.Duration("tolerance", 5*time.Millisecond, "apparent rate on the upstream's clock: allowed transit noise (printed, not failed)")
	connSlack      = flag.Int("conn-slack", 8, "allowed growth of connected_clients per Redis and Caddy after the quiet spell: the plugin's reaper closes the connections a burst or a fault opened once idle for conn-idle (the pools keep up to 64 each, so steady load dials nothing), so what is left is what the probes just used, a Pub/Sub connection per server, and the soak's own; the check looks again for up to conn-idle/6 before it fails")
	connIdle       = flag.Duration("conn-idle", time.Minute, "the plugin's idle-connection time (internal/redisconn ConnMaxIdle): its reaper closes a connection idle this long within a sixth more, so the quiet spell after the faults lasts 7/6 of this and a second")
	goroSlack      = flag.Int("goroutine-slack", 40, "allowed growth of go_goroutines per Caddy")
	keepDir        = flag.Bool("keep", false, "keep the work directory (logs, configs)")
	deadline       = flag.Duration("deadline", 0, "hard stop for the whole run; 0 = duration + 2m")
	redlockPermits = flag.Bool("redlock-permits", false, "also run a permits 2 route over the 3-server Redlock (/rp/); redis_lock refuses that config since the soak found it unsafe, so this only shows the refusal")
	rlFailOpen     = flag.Bool("rl-fail-open", false, "drop fail_closed from the rate-limited route (a self-test: Redis faults must then show as limit violations)")
	fenceWorkers   = flag.Int("fence-workers", 4, "clients on the fenced-write route (/f/)")
	noFence        = flag.Bool("no-fence", false, "drop redis_fence from the storage's route (a self-test: late writes must then show as stale writes stored)")
	flWorkers      = flag.Int("fl-workers", 2, "clients on the fail_local route (/fl/, faillocal.go)")
	onceWorkers    = flag.Int("once-workers", 2, "clients placing orders on the execute-once route (/once/, once.go)")
	noReplay       = flag.Bool("no-replay", false, "drop replay from the /once/ route (a self-test: retries then run again, and must show as keys run twice)")
	noFailLocal    = flag.Bool("no-fail-local", false, "drop fail_local from the /fl/ route (a self-test: it fails open, so outages of the single Redis must show as local limits broken)")
	verboseFlt     = flag.Bool("v", false, "print every fault as it starts")
	onlyFaults     = flag.String("faults", "", "comma-separated words: draw only the fault kinds containing one of them (e.g. latency,pause); default all")
)

const (
	rateN      = 20
	rateWindow = time.Second
)

type soak struct {
	seed    int64
	start   time.Time
	redis   []*redisProc          // single, redlock1-3
	proxies [][]*faultproxy.Proxy // [caddy][redis]
	caddies []*caddyProc
	check   *checker
	tally   *tally
	win     windows
	maxTTL  time.Duration
}

func main() {
	go spawner()
	flag.Parse()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		s := <-sig
		fmt.Fprintf(os.Stderr, "soak: %v: stopping children\n", s)
		cleanup()
		os.Exit(130)
	}()
	limit := *deadline
	if limit == 0 {
		limit = *duration + 2*time.Minute
	}
	time.AfterFunc(limit, func() {
		fmt.Fprintf(os.Stderr, "soak: not done after %v: stopping\n", limit)
		cleanup()
		os.Exit(1)
	})
	code := 0
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		code = 1
	}
	cleanup()
	os.Exit(code)
}

func cleanup() {
	killAll()
	if workDir == "" {
		return
	}
	if *keepDir {
		fmt.Fprintln(os.Stderr, "soak: work directory kept:", workDir)
		return
	}
	os.RemoveAll(workDir)
}

// caddyfile is instance c's config. The two variants are equivalent for
// the checker (another ttl and timeout), so a reload changes the config
// without changing what is promised.
func (s *soak) caddyfile(c *caddyProc, variant int) string {
	ttl, stallTTL, timeout := "2s", "1s", "300ms"
	if variant == 1 {
		ttl, stallTTL, timeout = "2500ms", "1200ms", "400ms"
	}
	p := func(r int) string { return s.proxies[c.idx][r].Addr() }
	redlock := p(1) + " " + p(2) + " " + p(3)
	lock := func(path, opts string) string {
		return fmt.Sprintf("\thandle /%s/* {\n\t\tredis_lock {\n%s\t\t\ttimeout %s\n\t\t}\n\t\treverse_proxy %s\n\t}\n",
			path, opts, timeout, s.check.url)
	}
	failPolicy := "fail_closed"
	if *rlFailOpen {
		failPolicy = "# fail open (-rl-fail-open)"
	}
	rp := ""
	if *redlockPermits {
		rp = lock("rp", fmt.Sprintf("\t\t\tttl %s\n\t\t\twait 3s\n\t\t\tpermits 2\n\t\t\tredis %s\n", ttl, redlock))
	}
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
	persist_config off
	storage file_system %s
	log {
		level ERROR
	}
}

http://127.0.0.1:%d {
	request_header X-Instance %d
`, c.adminPort, filepath.Join(workDir, "data-"+c.name()), c.port, c.idx) +
		lock("s", fmt.Sprintf("\t\t\tttl %s\n\t\t\twait 3s\n\t\t\tredis %s\n", ttl, p(0))) +
		lock("r", fmt.Sprintf("\t\t\tttl %s\n\t\t\twait 3s\n\t\t\tredis %s\n", ttl, redlock)) +
		lock("p", fmt.Sprintf("\t\t\tttl %s\n\t\t\twait 3s\n\t\t\tpermits 2\n\t\t\tredis %s\n", ttl, p(0))) +
		rp +
		lock("stall", fmt.Sprintf("\t\t\tttl %s\n\t\t\twait 1s\n\t\t\tauto_extend on\n\t\t\tredis %s\n", stallTTL, p(0))) +
		lock("f", fmt.Sprintf("\t\t\tttl %s\n\t\t\twait 3s\n\t\t\tredis %s\n", stallTTL, p(0))) +
		s.fenceRoute(timeout, p(0)) +
		s.flRoute(timeout, p(0)) +
		s.onceRoute(stallTTL, timeout, p(0)) +
		lock("probe", fmt.Sprintf("\t\t\tttl %s\n\t\t\tredis %s\n", ttl, redlock)) +
		lock("bad", fmt.Sprintf("\t\t\tkey {http.request.header.X-Missing}\n\t\t\tredis %s\n", p(0))) +
		fmt.Sprintf(`	handle /rl/* {
		redis_ratelimit {
			key {http.request.uri.path}
			rate %d %s
			%s
			timeout %s
			redis %s
		}
		request_header X-Admitted {time.now.unix_ms}
		reverse_proxy %s
	}
	respond 404
}
`, rateN, rateWindow, failPolicy, timeout, p(0), s.check.url)
}

// fenceRoute is the storage's route of the fencing tier (fence.go): the
// fence's key is the lock's, /f/<k> for a write to /w/<k>.
func (s *soak) fenceRoute(timeout, redis string) string {
	fence := fmt.Sprintf("\t\tredis_fence {\n\t\t\tkey /f/{http.request.uri.path.1}\n\t\t\ttimeout %s\n\t\t\tredis %s\n\t\t}\n", timeout, redis)
	if *noFence {
		fence = "\t\t# no redis_fence (-no-fence)\n"
	}
	return "\thandle /w/* {\n\t\troute {\n" + fence + "\t\trequest_header X-Admitted {time.now.unix_ms}\n\t\t}\n\t\treverse_proxy " + s.check.url + "\n\t}\n"
}

func run() error {
	var err error
	if workDir, err = os.MkdirTemp("", "redisdlm-soak-"); err != nil {
		return err
	}
	if abs, err := filepath.Abs(*caddyBin); err == nil {
		*caddyBin = abs
	}
	if _, err := os.Stat(*caddyBin); err != nil {
		return fmt.Errorf("caddy binary: %w (run `make caddy`)", err)
	}
	s := &soak{seed: *seedFlag, start: time.Now(), tally: newTally(), maxTTL: 2500 * time.Millisecond}
	if s.seed == 0 {
		s.seed = time.Now().UnixNano() % 1_000_000_000
	}
	kinds := faultKinds
	if *onlyFaults != "" {
		kinds = nil
		for _, k := range faultKinds {
			for _, w := range strings.Split(*onlyFaults, ",") {
				if w != "" && strings.Contains(k, w) {
					kinds = append(kinds, k)
					break
				}
			}
		}
		if len(kinds) == 0 {
			return fmt.Errorf("-faults %q matches no fault kind", *onlyFaults)
		}
	}
	plan := schedule(s.seed, *duration, kinds)
	fmt.Fprintf(os.Stderr, "soak: seed %d (replay: make soak SOAK=%v SEED=%d), %d faults, work dir %s\n",
		s.seed, *duration, s.seed, len(plan), workDir)
	step := func(f string, a ...any) {
		fmt.Fprintf(os.Stderr, "[%6.1fs] "+f+"\n", append([]any{time.Since(s.start).Seconds()}, a...)...)
	}

	if s.check, err = startChecker(s.start); err != nil {
		return err
	}
	defer s.check.stop()
	for _, n := range redisNames {
		r, err := newRedis(n)
		if err != nil {
			return err
		}
		s.redis = append(s.redis, r)
	}
	for i := 0; i < 4; i++ {
		var row []*faultproxy.Proxy
		for j, r := range s.redis {
			p, err := faultproxy.New(fmt.Sprintf("caddy%d→%s", i, redisNames[j]), r.addr())
			if err != nil {
				return err
			}
			defer p.Close()
			row = append(row, p)
		}
		s.proxies = append(s.proxies, row)
		c := &caddyProc{idx: i}
		if c.port, err = freePort(); err != nil {
			return err
		}
		if c.adminPort, err = freePort(); err != nil {
			return err
		}
		s.caddies = append(s.caddies, c)
	}
	s.check.fenceURL = func() string { return s.caddies[rand.Intn(len(s.caddies))].url() }
	step("starting 4 redis-server, 16 proxies, 4 Caddy")
	for _, c := range s.caddies {
		if err := c.start(s); err != nil {
			return err
		}
	}

	step("warm-up: 3s of load")
	s.runLoad(time.Now().Add(3 * time.Second))
	base, err := s.measure()
	if err != nil {
		return fmt.Errorf("baseline: %w", err)
	}
	step("baseline: redis connections %v, caddy goroutines %v", base.conns, base.goros)

	step("fault phase: %v, %d faults", *duration, len(plan))
	faultStart := time.Now()
	done := make(chan error, 1)
	counts := map[string]int{}
	go func() {
		for i := range plan {
			f := &plan[i]
			time.Sleep(time.Until(faultStart.Add(f.at)))
			f.began = s.check.now()
			if *verboseFlt {
				step("fault %s", f)
			}
			if err := s.inject(*f); err != nil {
				done <- fmt.Errorf("fault %s: %w", f, err)
				return
			}
			counts[f.kind]++
		}
		done <- nil
	}()
	s.runLoad(faultStart.Add(*duration))
	if err := <-done; err != nil {
		return err
	}

	// Quiet long enough for the leases to end and for the plugin's reaper
	// to close the pools' idle connections (idle for conn-idle, closed
	// within two of its sweeps, conn-idle/12 apart).
	quiet := max(2*s.maxTTL, *connIdle+*connIdle/6+time.Second)
	step("faults over; quiet for %v", quiet)
	time.Sleep(quiet)
	if !waitGroup(&s.check.late, 10*time.Second) {
		return fmt.Errorf("late writes of the fencing tier still unsent 10s after the quiet spell")
	}
	probes := s.probe()
	end, err := s.measure()
	// A pool's last use may come a little after the faults end (a call
	// still waiting, the bytes a blackhole held delivered late): look again
	// for a while before calling the connections a leak.
	settled := time.Now()
	for settle := settled.Add(*connIdle / 6); err == nil && len(s.connDrift(base, end)) > 0 && time.Now().Before(settle); {
		time.Sleep(2 * time.Second)
		end, err = s.measure()
	}
	if err != nil {
		return fmt.Errorf("after the faults: %w", err)
	}
	if d := time.Since(settled); d > time.Second {
		step("connections looked at again for %v", d.Round(100*time.Millisecond))
	}
	held, noTTL, err := s.leftovers()
	if err != nil {
		return err
	}
	step("done")

	return s.report(plan, counts, base, end, probes, held, noTTL)
}

// probe asks every route of every instance once more until it answers 200
// (Redis recovered by itself); it returns the routes that never did.
func (s *soak) probe() []string {
	var failed []string
	for _, c := range s.caddies {
		for _, path := range []string{"/probe/x", "/s/probe", "/r/probe", "/p/probe", "/stall/probe", "/f/probe", fmt.Sprintf("/rl/probe%d", c.idx), fmt.Sprintf("/fl/probe%d", c.idx), "/once/probe"} {
			ok := false
			for deadline := time.Now().Add(10 * time.Second); !ok && time.Now().Before(deadline); {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				code, err := getStatus(ctx, c.url()+path)
				cancel()
				ok = err == nil && code == 200
				if !ok {
					time.Sleep(200 * time.Millisecond)
				}
			}
			if !ok {
				failed = append(failed, c.name()+" "+path)
			}
		}
	}
	return failed
}

// waitGroup waits for wg at most d.
func waitGroup(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

func joinOr(xs []string, none string) string {
	if len(xs) == 0 {
		return none
	}
	return strings.Join(xs, "; ")
}

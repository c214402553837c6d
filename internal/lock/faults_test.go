package lock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// faultClient wraps a real client and lets a test act on each command:
// hook runs instead of the call, and next sends it to Redis. It injects
// what a real Redis cannot: an answer lost after the write, a call held
// back on its way while later ones pass it.
type faultClient struct {
	Client
	hook atomic.Pointer[func(cmd redis.Cmder, next func() error) error]
}

func (f *faultClient) Process(ctx context.Context, cmd redis.Cmder) error {
	next := func() error { return f.Client.Process(ctx, cmd) }
	if h := f.hook.Load(); h != nil {
		return (*h)(cmd, next)
	}
	return next()
}

// Pipeline is a pipeline whose commands each meet the hook, in order, as
// they would on one connection.
func (f *faultClient) Pipeline() redis.Pipeliner {
	return &faultPipeline{Pipeliner: f.Client.Pipeline(), f: f}
}

type faultPipeline struct {
	redis.Pipeliner
	f    *faultClient
	cmds []redis.Cmder
}

func (p *faultPipeline) Process(_ context.Context, cmd redis.Cmder) error {
	p.cmds = append(p.cmds, cmd)
	return nil
}

func (p *faultPipeline) Exec(ctx context.Context) ([]redis.Cmder, error) {
	var first error
	for _, cmd := range p.cmds {
		if err := p.f.Process(ctx, cmd); err != nil && first == nil {
			first = err
		}
	}
	return p.cmds, first
}

func (f *faultClient) setHook(h func(cmd redis.Cmder, next func() error) error) { f.hook.Store(&h) }

// errLostAnswer is what a caller sees when the answer to a call that ran
// is lost: a timeout.
var errLostAnswer = lostAnswer{}

type lostAnswer struct{}

func (lostAnswer) Error() string { return "i/o timeout (answer lost after the write)" }
func (lostAnswer) Timeout() bool { return true }

// scriptCall tells which lock script cmd calls and the token it carries
// ("" when it is no such call).
func scriptCall(cmd redis.Cmder) (script *redisconn.Script, token string) {
	a := cmd.Args()
	if len(a) < 4 {
		return nil, ""
	}
	name, _ := a[0].(string)
	body, _ := a[1].(string)
	nkeys, _ := a[2].(int)
	for _, s := range []*redisconn.Script{acquireScript, releaseScript, extendScript} {
		if (name == "evalsha" && body == s.Hash()) || (name == "eval" && body == s.Source()) {
			if len(a) > 3+nkeys {
				token, _ = redisconn.Arg(a[3+nkeys])
			}
			return s, token
		}
	}
	return nil, ""
}

// heldArgs are the arguments of a call a test holds back on its way to
// Redis, copied so that it can land later, on a connection of its own.
func heldArgs(cmd redis.Cmder) []any {
	a := cmd.Args()
	out := make([]any, len(a))
	for i, x := range a {
		if s, ok := redisconn.Arg(x); ok {
			x = s
		}
		out[i] = x
	}
	return out
}

// testLocker builds a locker over rs whose servers' clients are wrapped in
// faultClients (returned in server order).
func testLocker(t *testing.T, rs []*testredis.Server, o Options) (*Locker, []*faultClient) {
	t.Helper()
	return testInstance(t, "", rs, o)
}

// testInstance is testLocker for another Caddy instance on the same
// servers (a handler with other connection settings looks the same): its
// servers have clients and ids of their own, so it has its own local
// queues, wait-list id and wake-up listeners.
func testInstance(t *testing.T, instance string, rs []*testredis.Server, o Options) (*Locker, []*faultClient) {
	t.Helper()
	discard := func() *slog.Logger { return slog.New(slog.DiscardHandler) }
	var servers []*Server
	var fcs []*faultClient
	for i, r := range rs {
		// A client as the plugin builds one (its timeouts, no resend).
		check := redisconn.NewCheck(redisconn.CheckOptions{Logger: discard})
		c, err := redisconn.Settings{Mode: "single", Addrs: []string{r.Addr}, Timeout: o.Timeout}.NewClient(check)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		// Loaded first, so each script call is one command (no NOSCRIPT
		// and EVAL after a hooked EVALSHA).
		for _, sc := range []*redisconn.Script{acquireScript, releaseScript, releaseStoreScript, extendScript, renewScript, fenceRaiseScript, keepAnswerScript} {
			if err := c.ScriptLoad(context.Background(), sc.Source()).Err(); err != nil {
				t.Fatal(err)
			}
		}
		s := NewServer(fmt.Sprintf("%s/%s/%d/%s", t.Name(), instance, i, r.Addr), redisconn.NewConn(c, o.Timeout), discard)
		t.Cleanup(func() { s.wake.stop() })
		fc := &faultClient{Client: s.client}
		s.setClient(fc)
		servers, fcs = append(servers, s), append(fcs, fc)
	}
	l := New(servers, o, slog.New(slog.DiscardHandler))
	t.Cleanup(l.Close)
	return l, fcs
}

func startServers(t *testing.T, n int) []*testredis.Server {
	rs := make([]*testredis.Server, n)
	for i := range rs {
		rs[i] = testredis.Start(t)
	}
	return rs
}

// onOneAndThreeServers runs f as parallel subtests on one Redis server and
// on a Redlock of three.
func onOneAndThreeServers(t *testing.T, f func(t *testing.T, rs []*testredis.Server)) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d servers", n), func(t *testing.T) {
			t.Parallel()
			f(t, startServers(t, n))
		})
	}
}

// allFree waits (up to d) until no server holds key.
func allFree(d time.Duration, key string, rs []*testredis.Server) bool {
	return waitFor(d, func() bool {
		for _, r := range rs {
			if heldBy(r, key) != 0 {
				return false
			}
		}
		return true
	})
}

// waitClosed waits for ch (bounded, so a broken test ends by itself).
func waitClosed(ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-time.After(10 * time.Second):
		return errors.New("timed out")
	}
}

func testOptions() Options {
	return Options{TTL: 30 * time.Second, Wait: 0, BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond,
		Permits: 1, Timeout: 2 * time.Second}
}

// TestReleaseOvertakesAcquire: on a Redlock, the release of a lease can
// reach a member before the lease's own acquire (held back on its way there
// after a majority granted it). The release marks the token dead there, so
// that acquire takes nothing when it arrives: the same instance's next
// request, sent as soon as the release answered, gets the lock although
// another member's release is still on its way.
func TestReleaseOvertakesAcquire(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 3)
	l, fcs := testLocker(t, rs, testOptions())
	key := "caddy:lock:{overtake}"

	var token1 atomic.Value
	goAcq, executed, reply := make(chan struct{}), make(chan struct{}), make(chan struct{})
	goRel := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(reply); close(goRel) }) }
	defer unblock()
	// Member 2: the first acquire waits on its way, runs, then its answer
	// waits too.
	var first atomic.Bool
	fcs[2].setHook(func(cmd redis.Cmder, next func() error) error {
		if s, _ := scriptCall(cmd); s == acquireScript && first.CompareAndSwap(false, true) {
			if err := waitClosed(goAcq); err != nil {
				return err
			}
			err := next()
			close(executed)
			_ = waitClosed(reply)
			return err
		}
		return next()
	})
	// Member 1: the first lease's release waits on its way.
	fcs[1].setHook(func(cmd redis.Cmder, next func() error) error {
		if s, tok := scriptCall(cmd); s == releaseScript && tok == token1.Load() {
			_ = waitClosed(goRel)
		}
		return next()
	})

	ls, err := l.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatalf("first acquire: %v", err)
	}
	token1.Store(ls.token)
	ls.Release() // answered by members 0 and 2; member 1's release waits
	close(goAcq)
	if err := waitClosed(executed); err != nil {
		t.Fatal("the held-back acquire never ran")
	}
	ls2, err := l.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatalf("the next request met its own previous lease: %v (member 2 holds %d)", err, heldBy(rs[2], key))
	}
	ls2.Release()
	unblock()
	if !allFree(10*time.Second, key, rs) {
		t.Fatal("a member still holds the lock once every call arrived")
	}
	noKeyForever(t, rs)
}

// noKeyForever fails when a key on rs has no expiry.
func noKeyForever(t *testing.T, rs []*testredis.Server) {
	t.Helper()
	for _, r := range rs {
		keys, err := r.Client().Keys(context.Background(), "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			// -1: no expiry; -2: gone since KEYS (a Redlock member's
			// release may still be on its way when the caller returns).
			if ttl := r.Client().PTTL(context.Background(), k).Val(); ttl == -1 {
				t.Errorf("%s: key %s has no expiry (PTTL %v)", r, k, ttl)
			}
		}
	}
}

// TestLostAcquireAnswer: an acquire that ran in Redis but whose answer was
// lost (the caller saw a timeout) leaves nothing held: the attempt's
// owner-checked undo, or the lease's release, removes it, marks the token
// dead there (so the same call, delivered again late, would take nothing),
// and retries in the background when its own first call is lost too — on
// one server and on a Redlock of 3, whether the attempt failed or a
// majority still granted it.
func TestLostAcquireAnswer(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		servers     int
		lose        []int // servers whose acquire answer is lost
		loseRelease bool  // and whose first release call is lost on its way
		granted     bool
	}{
		{"1 server", 1, []int{0}, false, false},
		{"1 server, release lost too", 1, []int{0}, true, false},
		{"3 servers, majority lost", 3, []int{0, 1}, false, false},
		{"3 servers, majority lost, release lost too", 3, []int{0, 1}, true, false},
		{"3 servers, minority lost", 3, []int{2}, false, true},
		{"3 servers, minority lost, release lost too", 3, []int{2}, true, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rs := startServers(t, c.servers)
			l, fcs := testLocker(t, rs, testOptions())
			key := "caddy:lock:{lost}"
			var token atomic.Value
			ran := make(chan struct{}, len(c.lose))
			for _, i := range c.lose {
				var acqLost, relLost atomic.Bool
				fcs[i].setHook(func(cmd redis.Cmder, next func() error) error {
					s, tok := scriptCall(cmd)
					switch {
					case s == acquireScript && acqLost.CompareAndSwap(false, true):
						token.Store(tok)
						if err := next(); err != nil {
							return err
						}
						ran <- struct{}{}
						cmd.SetErr(errLostAnswer) // it ran; the answer is lost
						return errLostAnswer
					case s == releaseScript && c.loseRelease && relLost.CompareAndSwap(false, true):
						cmd.SetErr(errLostAnswer) // lost on its way: it never ran
						return errLostAnswer
					}
					return next()
				})
			}
			ls, err := l.Acquire(context.Background(), []string{key})
			for range c.lose {
				if waitClosed(ran) != nil {
					t.Fatal("the acquire never ran")
				}
			}
			if c.granted {
				if err != nil {
					t.Fatalf("acquire: %v, want granted by the majority", err)
				}
				ls.Release()
			} else if !errors.Is(err, ErrUnavailable) {
				t.Fatalf("acquire: %v, want ErrUnavailable", err)
			}
			if !allFree(10*time.Second, key, rs) {
				t.Fatal("the lock is still held after an acquire whose answer was lost")
			}
			for _, i := range c.lose {
				if _, err := rs[i].Client().ZScore(context.Background(), DeadKey(key), token.Load().(string)).Result(); err != nil {
					t.Errorf("server %d: the token is not marked dead: %v", i, err)
				}
			}
			ls2, err := l.Acquire(context.Background(), []string{key})
			if err != nil {
				t.Fatalf("the next acquire: %v", err)
			}
			ls2.Release()
			noKeyForever(t, rs)
		})
	}
}

// TestBatchedAcquiresLost: the acquires of concurrent requests that leave
// in one pipeline, whose answers are all lost after Redis ran them, each
// fail as an outcome nobody knows (nothing is sent again): every request
// gets ErrUnavailable, and its undo removes what the acquire took and
// marks its token dead, so no key stays held (a lost batch makes
// every call in it an unknown outcome).
func TestBatchedAcquiresLost(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	l, fcs := testLocker(t, rs, testOptions())
	const n = 10
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("caddy:lock:{batch%d}", i)
	}
	hold := make(chan struct{})
	var holdOnce sync.Once
	unhold := func() { holdOnce.Do(func() { close(hold) }) }
	defer unhold()
	var held, ran atomic.Int32
	var tokens sync.Map // key -> token of its acquire
	fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
		s, tok := scriptCall(cmd)
		if s != acquireScript {
			return next()
		}
		key, _ := redisconn.Arg(cmd.Args()[3])
		if key == keys[0] || key == keys[1] {
			// The first two are on their way while the others queue.
			held.Add(1)
			<-hold
			return next()
		}
		tokens.Store(key, tok)
		if err := next(); err != nil {
			return err
		}
		ran.Add(1)
		cmd.SetErr(errLostAnswer)
		return errLostAnswer
	})
	errs := make([]error, n)
	leases := make([]*Lease, n)
	var wg sync.WaitGroup
	acquire := func(i int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			leases[i], errs[i] = l.Acquire(context.Background(), []string{keys[i]})
		}()
	}
	acquire(0)
	acquire(1)
	if !waitFor(10*time.Second, func() bool { return held.Load() == 2 }) {
		t.Fatal("the first two acquires never went out")
	}
	for i := 2; i < n; i++ {
		acquire(i)
	}
	if !waitFor(10*time.Second, func() bool { return l.servers[0].pipe.Queued() == n-2 }) {
		t.Fatalf("%d acquires queued, want %d", l.servers[0].pipe.Queued(), n-2)
	}
	unhold()
	wg.Wait()
	for i := 0; i < 2; i++ {
		if errs[i] != nil {
			t.Fatalf("acquire %d (answered): %v", i, errs[i])
		}
		leases[i].Release()
	}
	if ran.Load() != n-2 {
		t.Fatalf("%d of the batched acquires ran, want %d (each once)", ran.Load(), n-2)
	}
	for i := 2; i < n; i++ {
		if !errors.Is(errs[i], ErrUnavailable) {
			t.Errorf("acquire %d, answer lost: %v, want ErrUnavailable", i, errs[i])
		}
	}
	for i := 0; i < n; i++ {
		if !allFree(10*time.Second, keys[i], rs) {
			t.Fatalf("%s is still held", keys[i])
		}
	}
	for i := 2; i < n; i++ {
		tok, _ := tokens.Load(keys[i])
		if _, err := rs[0].Client().ZScore(context.Background(), DeadKey(keys[i]), tok.(string)).Result(); err != nil {
			t.Errorf("%s: the lost acquire's token is not marked dead: %v", keys[i], err)
		}
	}
	noKeyForever(t, rs)
}

// TestBackgroundReleaseLost: a lease of one key on one server released in
// the background leaves with the next pipeline and nobody waits for its
// answer; when that answer is lost (the release never ran, or it ran and
// only its answer was lost), the server's releaser sends it again, the
// key is free, and the next acquire gets it. Twenty leases are released at
// once, so most releases ride in a pipeline with others.
func TestBackgroundReleaseLost(t *testing.T) {
	t.Parallel()
	for _, ran := range []bool{false, true} {
		t.Run(fmt.Sprintf("ran=%v", ran), func(t *testing.T) {
			t.Parallel()
			rs := startServers(t, 1)
			l, fcs := testLocker(t, rs, testOptions())
			const n = 20
			lost := "caddy:lock:{bg-lost-7}"
			var sent atomic.Int32
			fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
				if s, _ := scriptCall(cmd); s == releaseScript && firstKey(cmd) == lost {
					if sent.Add(1) == 1 {
						if ran {
							if err := next(); err != nil {
								return err
							}
						}
						cmd.SetErr(errLostAnswer)
						return errLostAnswer
					}
				}
				return next()
			})
			ctx := context.Background()
			leases := make([]*Lease, n)
			for i := range leases {
				var err error
				if leases[i], err = l.Acquire(ctx, []string{fmt.Sprintf("caddy:lock:{bg-lost-%d}", i)}); err != nil {
					t.Fatalf("acquire %d: %v", i, err)
				}
			}
			for _, ls := range leases {
				ls.ReleaseInBackground("")
			}
			for i := range leases {
				if key := fmt.Sprintf("caddy:lock:{bg-lost-%d}", i); !allFree(10*time.Second, key, rs) {
					t.Fatalf("%s is still held after its release", key)
				}
			}
			// Sent again by the releaser (with ran=true the first one
			// freed the key already: the second finds nothing).
			if !waitFor(10*time.Second, func() bool { return sent.Load() >= 2 }) {
				t.Fatalf("the lost release was sent %d times, want it sent again", sent.Load())
			}
			if !waitFor(10*time.Second, func() bool { return l.servers[0].rel.pendingCount() == 0 }) {
				t.Fatal("releases still owed")
			}
			// Every release settled: its lease gave its local queue back.
			if !waitFor(10*time.Second, func() bool { return l.queueCount() == 0 }) {
				t.Fatalf("%d local queues left: a release never settled", l.queueCount())
			}
			ls, err := l.Acquire(ctx, []string{lost})
			if err != nil {
				t.Fatalf("the next acquire: %v", err)
			}
			ls.Release()
			noKeyForever(t, rs)
		})
	}
}

// firstKey is a script call's first key ("" for none).
func firstKey(cmd redis.Cmder) string {
	a := cmd.Args()
	if len(a) < 4 {
		return ""
	}
	k, _ := redisconn.Arg(a[3])
	return k
}

// TestClientHookPanics: a hook of the client that panics while one
// server's acquire is sent fails that acquire (ErrUnavailable), with the
// panic logged, and never crashes the process; one that panics while a
// release nobody waits for is sent fails that release and logs the panic
// with its stack, and the server's releaser sends the release again: the
// key is free, and every local queue is given back.
func TestClientHookPanics(t *testing.T) {
	t.Parallel()
	rs := startServers(t, 1)
	l, fcs := testLocker(t, rs, testOptions())
	logs := &logRecorder{}
	l.SetLogger(slog.New(logs)) // before anything runs in the background
	var onAcquire, onRelease atomic.Bool
	fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
		switch s, _ := scriptCall(cmd); {
		case s == acquireScript && onAcquire.CompareAndSwap(true, false):
			panic("hook exploded on an acquire")
		case s == releaseScript && onRelease.CompareAndSwap(true, false):
			panic("hook exploded on a release")
		}
		return next()
	})
	ctx := context.Background()
	key := "caddy:lock:{hook-panic}"
	onAcquire.Store(true)
	if _, err := l.Acquire(ctx, []string{key}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("acquire whose hook panicked: %v, want ErrUnavailable", err)
	}
	if n := len(logs.matching("panic")); n != 1 {
		t.Fatalf("%d panics logged, want 1", n)
	}
	onRelease.Store(true)
	ls, err := l.Acquire(ctx, []string{key})
	if err != nil {
		t.Fatalf("the next acquire: %v", err)
	}
	ls.ReleaseInBackground("")
	if !allFree(10*time.Second, key, rs) {
		t.Fatal("the key is still held after a release whose hook panicked")
	}
	if !waitFor(10*time.Second, func() bool { return len(logs.matching("panic")) == 2 }) {
		t.Fatalf("%d panics logged, want 2", len(logs.matching("panic")))
	}
	if rec := logs.matching("panic")[1]; fmt.Sprint(rec.attrs["panic"]) != "hook exploded on a release" || rec.attrs["stack"] == "" {
		t.Fatalf("the release's panic is not logged with its stack: %v", rec.attrs)
	}
	if !waitFor(10*time.Second, func() bool { return l.servers[0].rel.pendingCount() == 0 && l.queueCount() == 0 }) {
		t.Fatalf("%d releases owed, %d local queues left", l.servers[0].rel.pendingCount(), l.queueCount())
	}
	noKeyForever(t, rs)
}

package redisdlm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Tests of the second review of the lock engine (issue 19, item 5); each
// failed before its fix.

// gateProxy forwards TCP to a Redis. While armed, a chunk from the client
// that contains all of match is held back until open is called: the
// client's connection is then cut at once (lost: the answer never comes)
// or left hanging (the call is still in flight), and the held command
// reaches Redis later, on a connection of its own. Its answer goes to
// landed.
type gateProxy struct {
	addr   string
	target string
	lost   bool // cut the client's connection when a chunk is held
	armed  atomic.Bool
	held   atomic.Int32
	gate   chan struct{}
	landed chan string
}

func startGateProxy(t *testing.T, target string, lost bool, match ...[]byte) *gateProxy {
	t.Helper()
	p := &gateProxy{target: target, lost: lost, gate: make(chan struct{}), landed: make(chan string, 16)}
	p.addr = startInterceptProxy(t, target, func(chunk []byte, c, s net.Conn) bool {
		if !p.armed.Load() || !containsAll(chunk, match) {
			return true
		}
		if p.lost {
			c.Close()
			s.Close()
		}
		go p.land(t, append([]byte(nil), chunk...))
		p.held.Add(1)
		return false // a hanging connection gets nothing more
	})
	return p
}

func containsAll(b []byte, match [][]byte) bool {
	for _, m := range match {
		if !bytes.Contains(b, m) {
			return false
		}
	}
	return true
}

// land sends a held command to Redis once the gate opens.
func (p *gateProxy) land(t *testing.T, cmd []byte) {
	<-p.gate
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		p.landed <- "dial: " + err.Error()
		return
	}
	defer s.Close()
	_ = s.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.Write(cmd); err != nil {
		p.landed <- "write: " + err.Error()
		return
	}
	buf := make([]byte, 4096)
	n, err := s.Read(buf)
	if err != nil {
		p.landed <- "read: " + err.Error()
		return
	}
	p.landed <- string(buf[:n])
}

// open lets the held commands go on, and returns the answers of n of them.
func (p *gateProxy) open(t *testing.T, n int) []string {
	t.Helper()
	close(p.gate)
	var out []string
	for i := 0; i < n; i++ {
		select {
		case a := <-p.landed:
			out = append(out, a)
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d held commands reached redis", i, n)
		}
	}
	return out
}

// TestUndoMarksEveryUnknownKeyDead: a Redlock attempt on keys {a, b} whose
// answer for a was lost on the third server (the acquire still on its way
// there) and that then found b busy everywhere: its undo marks the token
// dead for a on every server, so the acquire that reaches the third server
// late takes nothing. Before, the undo passed only b's unknown flag (false),
// and a stayed held there for the ttl by a token nobody owned.
func TestUndoMarksEveryUnknownKeyDead(t *testing.T) {
	t.Parallel()
	rs, _ := startRedlock(t, 3)
	prefix := "caddy:lock:"
	ka, kb := storedKey(prefix, "a"), storedKey(prefix, "b")
	// The third server loses the answer to a's acquire; the other two
	// answer b a little late (known answers, after a's loss is known).
	p3 := startGateProxy(t, rs[2].Addr, true, []byte(lock.AcquireScript.Hash()), []byte(ka))
	p1 := startDelayProxy(t, rs[0].Addr, []byte(kb), 150*time.Millisecond)
	p2 := startDelayProxy(t, rs[1].Addr, []byte(kb), 150*time.Millisecond)
	h := provisionLock(t, fmt.Sprintf(`{"redis":[%q,%q,%q],"timeout":"1s","wait":"0s","ttl":"20s"}`, p1.addr, p2.addr, p3.addr))
	keys := []string{ka, kb}
	warm, err := h.locker.Acquire(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	warm.Release()
	for _, r := range rs { // a rival holds b everywhere
		r.Client().ZAdd(context.Background(), kb, redisZ(time.Now().Add(time.Minute), "rival"))
	}
	p1.armed.Store(true)
	p2.armed.Store(true)
	p3.armed.Store(true)
	if _, err := h.locker.Acquire(context.Background(), keys); !errors.Is(err, ErrNotObtained) {
		t.Fatalf("b is held by a rival: %v, want ErrNotObtained", err)
	}
	if p3.held.Load() != 1 {
		t.Fatalf("%d acquires of a held back on the third server, want 1", p3.held.Load())
	}
	time.Sleep(100 * time.Millisecond) // the undo has reached every server
	ans := p3.open(t, 1)[0]
	if n := heldBy(rs[2], ka); n != 0 {
		pttl := rs[2].Client().PTTL(context.Background(), ka).Val()
		t.Fatalf("the late acquire holds a on the third server for a token nobody owns (answer %q, PTTL %v)", ans, pttl)
	}
	if !freeWithin(time.Second, ka, rs...) {
		t.Fatal("a is still held somewhere after the attempt failed")
	}
}

// delayHook holds back one command of a client (by name) for delay.
type delayHook struct {
	name  string
	delay time.Duration
}

func (h delayHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h delayHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == h.name {
			time.Sleep(h.delay)
		}
		return next(ctx, cmd)
	}
}
func (h delayHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestWaiterLeavesWaitqBeforeClientCloses: a waiter that gives up just as
// its client is closed (the end of a reload's grace) still takes its
// instance out of the key's Redis wait list. Before, the server reference
// was dropped before the ZREM ran: the client closed first, and the entry
// stayed at the head of the list, so other instances were refused the free
// lock until it expired.
func TestWaiterLeavesWaitqBeforeClientCloses(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	// backoff_max 5s: a wait-list entry lives 11s, far longer than the test.
	h := provisionLock(t, lockCfg(r.Addr, `"wait":"0s","timeout":"2s","backoff_max":"5s"`))
	key := storedKey(h.Prefix, "/waitq")
	rc := r.Client()
	rc.ZAdd(context.Background(), key, redisZ(time.Now().Add(time.Minute), "other-instance"))
	s := h.locker.Servers()[0]
	s.Client().AddHook(delayHook{name: "zrem", delay: 300 * time.Millisecond})
	if _, err := h.locker.Acquire(context.Background(), []string{key}); !errors.Is(err, ErrNotObtained) {
		t.Fatalf("key held elsewhere: %v, want ErrNotObtained", err)
	}
	// The reload's grace ends right now: the client closes once idle.
	s.CloseWhenIdle(func() { _ = s.Client().Close() })
	gone := waitFor(3*time.Second, func() bool {
		return rc.ZScore(context.Background(), lock.WaitqKey(key), h.locker.InstanceID()).Err() == redis.Nil
	})
	if !gone {
		t.Fatal("this instance is still in the key's wait list after its last waiter gave up (the ZREM met a closed client)")
	}
}

// TestLeaveWaitqRecoversPanic: a panic while leaving the wait list is
// logged, never a crash of the process.
func TestLeaveWaitqRecoversPanic(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"wait":"0s"`))
	core, logs := observer.New(zapcore.ErrorLevel)
	h.locker.SetLogger(slogFor(zap.New(core)))
	key := storedKey(h.Prefix, "/waitq-panic")
	r.Client().ZAdd(context.Background(), key, redisZ(time.Now().Add(time.Minute), "other-instance"))
	h.locker.Servers()[0].Client().AddHook(panicOn{name: "zrem"})
	if _, err := h.locker.Acquire(context.Background(), []string{key}); !errors.Is(err, ErrNotObtained) {
		t.Fatalf("key held elsewhere: %v, want ErrNotObtained", err)
	}
	if !waitFor(3*time.Second, func() bool { return logs.FilterMessageSnippet("panic").Len() > 0 }) {
		t.Fatal("the panic while leaving the wait list was not logged")
	}
}

// panicOn panics on one command of a client (by name).
type panicOn struct{ name string }

func (h panicOn) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h panicOn) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == h.name {
			panic(h.name + " exploded")
		}
		return next(ctx, cmd)
	}
}
func (h panicOn) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestLateExtensionDoesNotRecreateReleasedLease: a Redlock lease of two
// keys whose extension to one member (restarted empty) was still in flight,
// or whose answer was lost, when the lease was released: the extension
// that reaches the member after the release does not re-create the lease
// there. Before, keeper.stop returned while the call was on its way; the
// release found nothing on the member, and the late extension re-created
// the lease there for a whole ttl.
func TestLateExtensionDoesNotRecreateReleasedLease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		lost    bool
		timeout string
	}{{"in flight", false, "3s"}, {"answer lost", true, "3s"}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rs, _ := startRedlock(t, 3)
			p := startGateProxy(t, rs[2].Addr, tc.lost, []byte(lock.ExtendScript.Hash()))
			// A ttl that leaves a loaded machine room: the extensions come every ttl/3.
			h := provisionLock(t, fmt.Sprintf(`{"redis":[%q,%q,%q],"timeout":%q,"ttl":"6s"}`, rs[0].Addr, rs[1].Addr, p.addr, tc.timeout))
			keys := []string{storedKey(h.Prefix, "a"), storedKey(h.Prefix, "b")}
			ls, err := h.locker.Acquire(context.Background(), keys)
			if err != nil {
				t.Fatal(err)
			}
			rs[2].Restart() // the third member lost its state
			c := rs[2].Client()
			for _, src := range []string{lock.ExtendScript.Source(), lock.ReleaseScript.Source()} {
				c.ScriptLoad(context.Background(), src) // so the late EVALSHA finds its script
			}
			p.armed.Store(true)
			k := ls.Keep(lock.KeepOptions{Extend: true, OnLost: func(err error) { t.Errorf("lease lost: %v", err) }})
			if !waitFor(15*time.Second, func() bool { return p.held.Load() >= 2 }) {
				t.Fatalf("%d extensions held back on the third member, want 2 (one per key)", p.held.Load())
			}
			k.Stop()
			held := int(p.held.Load())
			before := rs[2].CommandCalls("evalsha")
			ls.Release()
			// The release has reached the third member (before the extensions).
			if !waitFor(5*time.Second, func() bool { return rs[2].CommandCalls("evalsha") >= before+2 }) {
				t.Fatal("the release did not reach the third member")
			}
			answers := p.open(t, held)
			for _, key := range keys {
				if n := heldBy(rs[2], key); n != 0 {
					t.Errorf("%s: the late extension re-created the released lease on the restarted member (answers %q, PTTL %v)",
						key, answers, c.PTTL(context.Background(), key).Val())
				}
			}
		})
	}
}

// makeReadOnly turns r into a replica of a master that does not exist: it
// refuses every write (READONLY), scripts included.
func makeReadOnly(t *testing.T, r *testRedis) {
	t.Helper()
	if err := r.Client().Do(context.Background(), "replicaof", "127.0.0.1", fmt.Sprint(freePort(t))).Err(); err != nil {
		t.Fatal(err)
	}
}

// TestRefusedAcquiresCountNoReleaseFailure: acquires that Redis refused
// with an answer (a read-only replica, or over maxmemory) held nothing:
// nothing is released for them, so caddy_redis_lock_release_failures_total
// does not rise and no release is left pending. Before, each refused
// acquire was undone by a release that was refused too: 64 refused
// acquires counted 64 release failures, each retried for 2 × ttl + 10s.
// Not parallel: the counter is global.
func TestRefusedAcquiresCountNoReleaseFailure(t *testing.T) {
	for _, tc := range []struct {
		name    string
		servers int
		refuse  func(t *testing.T, rs []*testRedis)
	}{
		{"read-only replica", 1, func(t *testing.T, rs []*testRedis) { makeReadOnly(t, rs[0]) }},
		{"over maxmemory", 1, func(t *testing.T, rs []*testRedis) { fillRedis(t, rs[0].Client()) }},
		{"redlock, two read-only members", 3, func(t *testing.T, rs []*testRedis) { makeReadOnly(t, rs[0]); makeReadOnly(t, rs[1]) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rs []*testRedis
			var addrs []string
			for i := 0; i < tc.servers; i++ {
				rs = append(rs, startRedis(t, "--maxmemory-policy", "noeviction"))
				addrs = append(addrs, fmt.Sprintf("%q", rs[i].Addr))
			}
			h := provisionLock(t, fmt.Sprintf(`{"redis":[%s],"wait":"0s","ttl":"2s"}`, strings.Join(addrs, ",")))
			tc.refuse(t, rs)
			before := releaseFailures(h.label)
			for i := 0; i < 64; i++ {
				_, err := h.locker.Acquire(context.Background(), []string{storedKey(h.Prefix, fmt.Sprintf("/k%d", i))})
				if !errors.Is(err, ErrUnavailable) {
					t.Fatalf("acquire %d refused by redis: %v, want ErrUnavailable", i, err)
				}
			}
			time.Sleep(200 * time.Millisecond) // late answers and their undos
			if n := releaseFailures(h.label) - before; n != 0 {
				t.Errorf("64 refused acquires counted %v release failures, want 0", n)
			}
			for i, s := range h.locker.Servers() {
				if n := s.PendingReleases(); n != 0 {
					t.Errorf("server %d: %d releases pending for acquires that held nothing", i, n)
				}
			}
		})
	}
}

// TestScriptErrorAfterWritesIsUndone: an acquire that Redis answered with
// an error raised while the script ran (here the key's fencing counter is
// of the wrong type, after the script took the lock) may have written: it
// is undone, unlike a call Redis refused without running it.
func TestScriptErrorAfterWritesIsUndone(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"wait":"0s"`))
	key := storedKey(h.Prefix, "/wrongtype")
	r.Client().HSet(context.Background(), lock.FenceKey(key), "not", "a counter")
	_, err := h.locker.Acquire(context.Background(), []string{key})
	if err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("acquire with a fencing counter of the wrong type: %v, want the WRONGTYPE error", err)
	}
	if !freeWithin(2*time.Second, key, r) {
		t.Fatal("the lock taken before the script's error is still held")
	}
}

// TestReleaseFailureLogNamesServerAndHandler: the warning about a release
// that Redis did not answer names the server and the handler; the key only
// at debug level (and hashed at warn).
func TestReleaseFailureLogNamesServerAndHandler(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	h := provisionLock(t, lockCfg(r.Addr, `"timeout":"300ms","name":"payments"`))
	core, logs := observer.New(zapcore.DebugLevel)
	h.locker.Servers()[0].SetLogger(func() *slog.Logger { return slogFor(zap.New(core)) })
	key := storedKey(h.Prefix, "/secret-key")
	ls, err := h.locker.Acquire(context.Background(), []string{key})
	if err != nil {
		t.Fatal(err)
	}
	r.Pause()
	ls.Release()
	r.Resume()
	if !freeWithin(5*time.Second, key, r) {
		t.Fatal("the release was not retried")
	}
	warns := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("releasing a lock failed").All()
	if len(warns) == 0 {
		t.Fatalf("no warning about the failed release: %v", logs.All())
	}
	f := warns[0].ContextMap()
	if f["server"] != r.Addr || f["handler"] != "payments" {
		t.Errorf("the warning names server %v and handler %v, want %s and payments", f["server"], f["handler"], r.Addr)
	}
	for name, v := range f {
		if strings.Contains(fmt.Sprint(v), "secret-key") {
			t.Errorf("the warning names the key in %s at warn level", name)
		}
	}
	if f["key_hash"] != lock.WakeID(key) {
		t.Errorf("the warning's key_hash is %v, want %s", f["key_hash"], lock.WakeID(key))
	}
	debug := logs.FilterLevelExact(zapcore.DebugLevel).FilterField(zap.String("key", key))
	if debug.Len() == 0 {
		t.Errorf("no debug line names the key: %v", logs.All())
	}
}

// Package redisconn is the connection layer both engines (internal/lock,
// internal/ratelimit) share: the resolved connection settings and their
// pool key, the addresses' checks and redaction, the go-redis client built
// from the settings and its lifetime (Conn counts its users), the reaper
// of its idle connections, the one way a Lua script is called (never
// resent), and the checks on the first connection to each server (version,
// maxmemory-policy).
//
// It knows nothing of Caddy or HTTP: the Caddy-side configuration
// (internal/shared's RedisConfig) resolves placeholders and converts into Settings.
//
// This file is its whole face: every exported function, method, constant,
// variable and type, by concern; the work of the longer functions is in
// the file of their concern, under the same name in lower case.
package redisconn

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Addresses: their checks, redaction and the server they name.

// HasPlaceholder reports whether a value still needs the replacer.
func HasPlaceholder(s string) bool {
	return strings.Contains(s, "{") && strings.Contains(s, "}")
}

// ValidateAddress checks one `host:port` or redis URL without dialing it.
// Its errors keep their reason and never contain a password.
func ValidateAddress(addr string) error { return validateAddress(addr) }

// RedactURL hides the password of a redis URL. Of something that is not a
// valid URL but holds an '@', it hides everything before the last '@'.
func RedactURL(s string) string { return redactURL(s) }

// ServerID names the Redis server that addr points at, so that two
// entries of a Redlock list can be told to be one server: the host
// lowercased (an IP in its canonical form, a DNS name without a trailing
// dot) and the port, 6379 when a URL gives none. Scheme, credentials and
// db do not count: two databases of one server fail together. Names are
// compared, never resolved (localhost and 127.0.0.1 stay apart). ok is
// false for an address that holds a placeholder or is invalid
// (ValidateAddress reports the latter).
func ServerID(addr string) (id string, ok bool) { return serverID(addr) }

// SameServer returns the indexes i < j of the first two entries of addrs
// that name one Redis server (ServerID), or -1, -1.
func SameServer(addrs []string) (int, int) { return sameServer(addrs) }

// DuplicateServerError says why a list of independent servers may not
// name one server twice. It never shows a password.
func DuplicateServerError(a, b string) error {
	const why = "a Redlock quorum needs independent servers, and a server listed twice would get two votes"
	id, _ := ServerID(b)
	if a == b {
		return fmt.Errorf("redis: %q is listed twice; %s", RedactURL(a), why)
	}
	return fmt.Errorf("redis: %q and %q are the same Redis server %s (only host and port count, not the db); %s", RedactURL(a), RedactURL(b), id, why)
}

// SeedURLs is what the URLs of a `cluster` or `sentinel` list carry
// besides their addresses; one list names one logical Redis, so its URLs
// must agree on it.
type SeedURLs struct {
	username, password, clientName string
	db                             int
	tls                            bool
	urls                           int // how many entries were URLs
}

// SplitSeeds turns the entries of a `cluster` or `sentinel` list (sub
// names it) into host:port addresses and returns what their URLs carry:
// user, password, db, client name and TLS (rediss://). Entries that still
// hold a placeholder are returned as they are and do not count. Its errors
// never show a password.
func SplitSeeds(sub string, addrs []string) ([]string, SeedURLs, error) {
	return splitSeeds(sub, addrs)
}

// Apply puts what the URLs carry into s: their user and password win over
// the directive's, so does a db other than 0, and rediss:// turns TLS on.
func (u SeedURLs) Apply(s *Settings) { u.apply(s) }

// The client built from Settings, and its users (Conn).

// Each client's pool per Redis server: up to PoolSize connections in use
// at once, and as many kept idle, so steady load dials nothing new (with a
// smaller idle cap, every connection handed back beyond it was closed and
// the next call dialled again: a handshake, HELLO and the server check per
// request once more requests were in flight than the cap). The pool
// shrinks after a burst or a slow Redis by time instead: the reaper
// (reaper.go) closes a connection no call used for ConnMaxIdle (plus up to
// two of its sweeps), with or without traffic, and the pool closes one
// idle that long, or older than ConnMaxLifetime (± ConnLifetimeJitter, so
// a burst's connections do not all go at once), when a call next takes
// it. The pool hands out its oldest idle connection first (FIFO): while
// calls take each idle connection within ConnMaxIdle (64 calls a minute
// will do), none is idle, so a burst's surplus then goes by lifetime.
// (Handing out the one used last made five tests fail under -race on a
// loaded machine; not pursued here.)
const PoolSize = 64

var (
	// vars only so that a test can shorten them
	ConnMaxIdle        = time.Minute
	ConnMaxLifetime    = 10 * time.Minute
	ConnLifetimeJitter = time.Minute
)

// NewClient builds (but does not dial) the go-redis client for s; check
// runs on every new connection.
func (s Settings) NewClient(check *Check) (redis.UniversalClient, error) { return s.newClient(check) }

// IsRedisDown reports whether err means Redis could not be reached or did
// not answer in time (as opposed to a script's answer).
func IsRedisDown(err error) bool { return isRedisDown(err) }

// RefusedForNow reports whether msg, an error reply of a live Redis, is a
// refusal that may pass later: out of memory, a read-only replica, busy,
// loading, a master or cluster down, a misconfigured save, too few
// replicas, a slot moving. Redis 7 ends one raised inside a script with
// "script: …, on @user_script:…"; its prefix tells it all the same.
func RefusedForNow(msg string) bool {
	for _, p := range []string{"OOM ", "READONLY ", "BUSY ", "LOADING ", "MASTERDOWN ", "MISCONF ", "NOREPLICAS ", "CLUSTERDOWN ", "TRYAGAIN "} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// ClientName names a client's server in log lines: its address, the
// addresses of a Cluster, or "sentinel" for a Sentinel group.
func ClientName(c redis.UniversalClient) string { return clientName(c) }

// Conn is one Redis client as both engines share it: the client, the
// bound of one call, and its users (requests holding or waiting for a
// lock on it, rate-limit calls, background releases). When its owner
// closes it, the client stays open until the last user is done, so a
// config reload never cuts off the release of a lock that an old request
// still holds.
type Conn struct {
	Client  redis.UniversalClient
	Timeout time.Duration // bound of one call

	mu      sync.Mutex
	users   int
	closing bool
	onIdle  func()
}

// NewConn wraps a client; nothing is dialed until the first call.
func NewConn(c redis.UniversalClient, timeout time.Duration) *Conn {
	return &Conn{Client: c, Timeout: timeout}
}

// Use and Unuse count a user of the client.
func (c *Conn) Use() {
	c.mu.Lock()
	c.users++
	c.mu.Unlock()
}

// Unuse ends a use; the last one after CloseWhenIdle closes the client.
func (c *Conn) Unuse() {
	c.mu.Lock()
	c.users--
	idle := c.closing && c.users == 0
	f := c.onIdle
	c.mu.Unlock()
	if idle && f != nil {
		go f()
	}
}

// CloseWhenIdle runs closeClient once no user is left (at once when none
// is); later calls do nothing.
func (c *Conn) CloseWhenIdle(closeClient func()) { c.closeWhenIdle(closeClient) }

// The pipe: the calls of concurrent requests batched into pipelines.

// Pipe sends the commands that concurrent callers hand it at the same
// moment as one pipeline: one write and one read on one connection for all
// of them, on Caddy's side and on Redis's, instead of a round trip each.
//
// There is no worker and no timer. A caller that finds fewer than
// PipeInFlight pipelines on their way sends at once, with whatever else
// waits (a lone call goes as a plain call, exactly as without the pipe);
// otherwise it waits in the queue, and the first caller whose pipeline is
// answered hands the queue on to a waiting caller, who sends it (or, when
// the queue's first call is one nobody waits for, to a goroutine started
// for it: see Sender). An idle pipe is nothing but a mutex and an empty
// queue.
//
// A pipeline is never sent again: a command of it whose answer was lost
// (a timeout, a dropped connection) gets that error, which for a script
// means an outcome nobody knows, for every command the pipeline had not
// answered yet. Its context ends at the latest deadline of its calls (at
// most the timeout from when it leaves); a call whose own deadline passed
// while it waited in the queue is answered unsent.
// The commands given to a Pipe must never be resent by go-redis (see
// NoRetry): Script calls are.
//
// A Pipe is used by its zero value; it carries no client: each call names
// the one to send on (the same for every call in practice, or a test's
// wrapper of it).
type Pipe struct {
	mu       sync.Mutex
	queue    []*pipeCall
	inflight int // pipelines on their way (each sent by a caller)
}

// PipeInFlight is the pipelines one Pipe has on their way at once. Two, not
// one: a pipeline that is slow to answer (a lost packet, a paused
// connection until its timeout) does not hold up every other call of the
// client meanwhile, and a caller arriving while one pipeline is on its way
// is sent at once rather than a round trip later. Under load each still
// carries what arrived while the other was out.
const PipeInFlight = 2

// Via is p as a Processor that sends on c, each call bounded by timeout
// (or its context's deadline, when earlier): a Script's call goes through
// the pipe with Script.Run(ctx, p.Via(c, timeout), ...). The caller needs
// no context with a deadline of its own: under load a call's bound costs
// nothing but the pipeline's one context.
//
// On a Cluster client the calls go one by one (each bounded by timeout):
// go-redis sends a pipeline as one sub-pipeline per node and waits for all
// of them, so one slow or failing node would hold up the calls of every
// other node in the same pipeline.
func (p *Pipe) Via(c Pipeliner, timeout time.Duration) Sender {
	if _, cluster := c.(*redis.ClusterClient); cluster {
		return timed{c, timeout}
	}
	return piped{p, c, timeout}
}

// Pipeliner is a client that sends a command alone or in a pipeline.
type Pipeliner interface {
	Processor
	Pipeline() redis.Pipeliner
}

// Sender is a Processor (one of Via) that also sends a command its caller
// does not wait for: done runs once cmd is answered, or failed (cmd holds
// the answer or the error), on a goroutine spawn started, never the
// caller's. spawn must not block, and must recover and report a panic of
// the function it runs: a hook of the client that panics while such a
// goroutine sends a pipeline fails every call of it with the panic, and
// the panic goes on there once they are all done. done must neither block
// nor panic: it runs with the done of the other calls of its pipeline.
// Under load, such a call costs no goroutine of its own (see send); on a
// Cluster client (each call alone, see Via) it is sent by one spawn starts.
type Sender interface {
	Processor
	Go(cmd redis.Cmder, done func(), spawn func(func()))
}

// Queued is how many calls wait in the queue (for tests).
func (p *Pipe) Queued() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queue)
}

// Lua scripts, each call sent once (never resent).

// Script is one of the plugin's Lua scripts. Its calls are never resent
// by go-redis after a transport error: a lock or limit script whose answer
// was lost may have run, and none of them may run twice (a Cluster client
// otherwise resends such a command, whatever MaxRetries says). A MOVED or
// ASK answer, which means the command did not run, is still followed.
// It has no other way to be called (go-redis's own Script methods would
// send commands that may be resent).
type Script struct {
	hash, src       string
	hashArg, srcArg any // the same, boxed once (not per call)
}

// NewScript prepares src; nothing is sent until a call.
func NewScript(src string) *Script {
	h := redis.NewScript(src).Hash()
	return &Script{hash: h, src: src, hashArg: h, srcArg: src}
}

// Hash is the script's SHA1, the name EVALSHA calls it by.
func (s *Script) Hash() string { return s.hash }

// Source is the script's text.
func (s *Script) Source() string { return s.src }

// Processor is a client or a pipeline.
type Processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// Run is Script.Run without resends: EVALSHA, then EVAL when Redis does not
// know the script (after a restart or SCRIPT FLUSH; NOSCRIPT means it did
// not run).
func (s *Script) Run(ctx context.Context, p Processor, keys []string, args ...any) *redis.Cmd {
	return s.RunArgv(ctx, p, append(s.Head(false, keys, len(args)), args...))
}

// Eval sends (or, on a pipeline, queues) EVAL with the script's text.
func (s *Script) Eval(ctx context.Context, p Processor, keys []string, args ...any) *redis.Cmd {
	return process(ctx, p, append(s.Head(true, keys, len(args)), args...))
}

// EvalArgv is Eval with the arguments of Argv (which must stay as they
// are until the call is answered).
func (s *Script) EvalArgv(ctx context.Context, p Processor, argv []any) *redis.Cmd {
	return process(ctx, p, s.evalArgv(argv))
}

// Go is RunArgv for a caller that does not wait: done gets the answer
// (see Sender; on NOSCRIPT the EVAL goes the same way). argv is one of
// Argv, and must stay as it is until done runs.
func (s *Script) Go(p Sender, argv []any, spawn func(func()), done func(*redis.Cmd)) {
	cmd := newCmd(context.Background(), argv)
	p.Go(NoRetry{cmd}, func() {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			eval := newCmd(context.Background(), s.evalArgv(argv))
			p.Go(NoRetry{eval}, func() { done(eval) }, spawn)
			return
		}
		done(cmd)
	}, spawn)
}

// Argv is a call's whole argument list, appended to buf[:0]: "evalsha",
// the script's SHA1, the number of keys, the keys (as Head puts them,
// so keys must stay as they are until the call is answered), then args.
// A call that runs often keeps buf in storage it has anyway, with room
// for 3+len(keys)+len(args): the command then makes no list of its own.
func (s *Script) Argv(buf []any, keys []string, args ...any) []any {
	buf = append(buf[:0], evalshaArg, s.hashArg, len(keys))
	for i := range keys {
		buf = append(buf, &keys[i])
	}
	return append(buf, args...)
}

// RunArgv is Run with the arguments of Argv (which must stay as they are
// until it returns).
func (s *Script) RunArgv(ctx context.Context, p Processor, argv []any) *redis.Cmd {
	cmd := process(ctx, p, argv)
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = s.EvalArgv(ctx, p, argv)
	}
	return cmd
}

// Head starts a call of the script: "evalsha", its SHA1 (or "eval", its
// text), the number of keys and the keys, with room for more arguments.
// Each key goes in as a *string, which costs no allocation to box: go-redis
// writes it as the string, and routes a Cluster or Ring command by it as
// by a string. keys must stay as they are until the command is answered
// (a MOVED answer, or NOSCRIPT, sends them again).
func (s *Script) Head(eval bool, keys []string, more int) []any {
	a := s.start(eval, len(keys), len(keys)+more)
	for i := range keys {
		a = append(a, &keys[i])
	}
	return a
}

// Arg is a command's argument as the string it stands for (a *string as
// Head and the engines' argument lists pass them, or a string).
func Arg(a any) (string, bool) {
	switch v := a.(type) {
	case string:
		return v, true
	case *string:
		if v != nil {
			return *v, true
		}
	}
	return "", false
}

// NoRetry and NoRetryInts are commands go-redis must not resend.
type (
	NoRetry     struct{ *redis.Cmd }
	NoRetryInts struct{ *redis.IntSliceCmd }
)

// NoRetry tells go-redis never to resend the command.
func (NoRetry) NoRetry() bool { return true }

// NoRetry tells go-redis never to resend the command.
func (NoRetryInts) NoRetry() bool { return true }

// The checks on each new connection (version, maxmemory-policy, the
// process's start).

// Check checks each server one client connects to, once per server
// (not per connection): go-redis calls onConnect for every new connection.
type Check struct {
	mu         sync.Mutex
	logger     func() *slog.Logger
	onEvicting func(c *Check, addr string, on bool)
	minVersion [2]int
	servers    map[string]*serverState // by address
	// failover names the master of a Sentinel group, whose connections do
	// not carry its address (go-redis names them "FailoverClient").
	failover string
	// restarts counts the servers seen with a run_id other than the one
	// seen before (a process restarted, or another server at the address).
	restarts atomic.Uint64
	// started is the latest process start (Redis TIME, µs) seen among the
	// servers; 0 while none is known.
	started atomic.Int64
}

// CheckOptions configure the checks of one client.
type CheckOptions struct {
	// Logger returns the logger of the moment (the client outlives configs).
	Logger func() *slog.Logger
	// Failover names the client's Sentinel group's master (the client's
	// redacted display name).
	Failover string
	// OnEvicting, if set, is told when a server of this client is found
	// with an evicting maxmemory-policy (on) and when that ends (off: the
	// policy changed, or Close).
	OnEvicting func(c *Check, addr string, on bool)
}

// NewCheck makes the checks of one client.
func NewCheck(o CheckOptions) *Check {
	return &Check{logger: o.Logger, onEvicting: o.OnEvicting, minVersion: minRedisVersion, servers: map[string]*serverState{}, failover: o.Failover}
}

// SetLogger replaces the logger (tests observe the checks' log lines).
func (sc *Check) SetLogger(l *slog.Logger) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	sc.logger = func() *slog.Logger { return l }
}

// SetMinVersion replaces the oldest version accepted (tests refuse a
// server as too old).
func (sc *Check) SetMinVersion(v [2]int) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	sc.minVersion = v
}

// Restarts counts the times a server of this client was found running a
// process other than the one seen before (its run_id changed: restarted,
// possibly empty, or failed over). A caller that keeps state a restart
// loses compares it before and after a call: the hook runs before a new
// connection's first command, so an answer that came from a new process
// is seen with the count already raised.
func (sc *Check) Restarts() uint64 { return sc.restarts.Load() }

// Started is the latest start of a server process of this client, in
// Redis TIME µs (never before the real start; see noteProcess), or 0
// while no connection could read it (INFO refused, or none made yet).
func (sc *Check) Started() int64 { return sc.started.Load() }

// Close withdraws this client's servers from the evicting ones (OnEvicting
// off for each).
func (sc *Check) Close() { sc.close() }

// Resolved connection settings.

// Settings is the resolved connection of one logical Redis (one
// server, one cluster or one sentinel group). Its JSON form is the pool key.
type Settings struct {
	Mode     string   `json:"mode"` // "single", "cluster" or "sentinel"
	Addrs    []string `json:"addrs"`
	Master   string   `json:"master,omitempty"`
	Username string   `json:"username,omitempty"`
	Password string   `json:"password,omitempty"`
	DB       int      `json:"db,omitempty"`
	TLS      bool     `json:"tls,omitempty"`
	CAFile   string   `json:"ca_file,omitempty"`
	CertFile string   `json:"cert_file,omitempty"`
	KeyFile  string   `json:"key_file,omitempty"`
	// TLSFiles is a digest of the TLS files' contents: a reload after the
	// files were replaced at the same paths gets a new client.
	TLSFiles string        `json:"tls_files,omitempty"`
	Timeout  time.Duration `json:"timeout"`
	// ClientName comes from the URLs of a cluster or sentinel list (a
	// single server's URL is read in NewClient).
	ClientName string `json:"client_name,omitempty"`
}

// PoolKey identifies identical settings; the password only enters as a hash.
func (s Settings) PoolKey() string {
	b, _ := json.Marshal(s)
	sum := sha256.Sum256(b)
	return "redisdlm:" + hex.EncodeToString(sum[:])
}

// Display names the server in logs and errors, never with a password.
func (s Settings) Display() string { return s.display() }

// FilesDigest is the SHA-256 of the named files' contents ("" for none; a
// file that cannot be read counts as empty: TLSConfig reports it).
func FilesDigest(names ...string) string { return filesDigest(names...) }

// TLSConfig reads the CA and client certificate files of s; nil when TLS
// is off (a rediss:// URL turns it on by itself in NewClient).
func (s Settings) TLSConfig() (*tls.Config, error) { return s.tlsConfig() }

// Package ratelimit is the rate-limit engine under redis_ratelimit. This
// file is its whole face: every exported function, method, constant and
// variable, and every exported type but the opaque ones (Batcher, Call,
// DenyCache, Fleet, ForgetListener, Limit, Local: their fields are
// unexported, declared with their work), is here; the work behind them is
// in the files of each concern.
//
// A Limit is one handler's limits under a prefix, decided by one
// Algorithm (sliding_window, gcra; algorithm.go has the interface, each
// algorithm a file and its Lua). A Plan is the rates and cost a request is
// decided by. The engine names every Redis key of a limit
// (<prefix>{<id>}...) and runs every script on them: a decision
// (Limit.DecisionCall, sent by a Batcher with the decisions of other
// requests in one pipeline and one script call), the return of an
// admission, the admin API's read and reset of a quota (Peek, PeekBan,
// Reset), the heartbeats of the instances sharing a prefix (Fleet), the
// charge of what fail_local's limiter admitted on its own (Local.Charge),
// and the resets and bans that reach every instance over Pub/Sub
// (ListenForget, Limit.AnnounceBan, WriteBackBans).
//
// It depends on the smallest client interface it needs (Client, Admin,
// ...) and tells time through a Clock, so its tests wrap a real client to
// inject what a real Redis cannot (an answer lost after the write) and move
// time without a sleep. It knows nothing of Caddy or HTTP: the handler
// (package redisratelimit) renders ids, rates and costs per request,
// answers HTTP, and logs what it is told of (an Observer of the breaker,
// the reports of a charge).
package ratelimit

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/redis/go-redis/v9"
)

// Rates, algorithms, limits and plans.

// Rate is one limit of a limit id: at most N units per Window, and with an
// algorithm that takes one (HasBurst) bursts up to Burst (0: N).
type Rate struct {
	N      int64
	Window time.Duration
	Burst  int64
}

// CheckRate reports why no algorithm can keep rate r (n below 1, a window
// below 1ms), or nil.
func CheckRate(r Rate) error { return checkRate(r) }

// Algorithm is one way to keep a rate in Redis: the name of its state's
// key, the arguments and answers of its scripts (the decision body under
// the batch driver, the charge of local admissions, the return of an
// admission), the step of the fail_local limiter deciding it alone, and
// the admin API's read of its state. Each is a small type in a file of its
// own with its Lua (sliding.go, gcra.go), registered by name in
// algorithms (algorithm.go): adding one touches that file, its scripts and
// one line there. The JSON config names it by Name.
type Algorithm interface {
	// Name is what configs call it ("algorithm": "gcra").
	Name() string
	// HasBurst reports whether its rates take a burst (Rate.Burst).
	HasBurst() bool
	// CheckRate reports why the algorithm cannot keep rate r (the rule
	// every rate keeps, CheckRate, and its own), or nil. Its burst is not
	// checked (see HasBurst).
	CheckRate(r Rate) error

	// withDefaults is r as the algorithm keeps it (gcra: burst n unless
	// given; others: no burst).
	withDefaults(r Rate) Rate
	// capacity is the largest cost one request may have on r.
	capacity(r Rate) int64
	// suffix is the tail of r's state key, after the limit id's hash tag;
	// parseSuffix reads it back.
	suffix(r Rate) string
	parseSuffix(s string) (Rate, bool)

	// decision is its decision script (the batch driver around its body).
	decision() *redisconn.Script
	// args appends r's arguments of a decision (its body's ARGN).
	args(argv []any, r Rate) []any
	// returnCall fills in c, the return of admission d of plan p.
	returnCall(c *Call, p *Plan, d Decision)
	// chargeScript is its script charging one rate's key with local
	// admissions, and chargeArgs the arguments that come before the
	// marker's life.
	chargeScript() *redisconn.Script
	chargeArgs(r Rate) []any

	// horizon is how far back an admission on r matters.
	horizon(r Rate) time.Duration
	// admitLocally decides one rate of the fail_local limiter at the share
	// of one of instances instances.
	admitLocally(l *Local, e *localRate, cost, instances int64, now time.Time) localStep
	// peek reads r's state raw (its key's value, "" when none) as a
	// decision at now (µs, Redis TIME) would count it without admitting:
	// the quota used and left, and µs until it grows (0: full).
	peek(raw string, now float64, r Rate) (used, remaining int64, reset float64)
}

// The algorithms a config may name.
var (
	SlidingWindow Algorithm = slidingWindow{} // exact sliding log (sliding.go)
	GCRA          Algorithm = gcra{}          // generic cell rate algorithm (gcra.go)
)

// MaxSlidingWindowRequests is the largest n of a sliding_window rate: a
// key at its limit holds n 8-byte times in Redis (about 0.9 MB at this n).
const MaxSlidingWindowRequests = 100000

// AlgorithmNamed returns the algorithm configs call name ("" is the
// default, the first of Algorithms), or an error listing the names.
func AlgorithmNamed(name string) (Algorithm, error) { return algorithmNamed(name) }

// Algorithms are the algorithms a config may name, the default first.
func Algorithms() []Algorithm { return append([]Algorithm(nil), algorithms...) }

// LimitOptions are what a limit's decisions do beyond counting.
type LimitOptions struct {
	// Ban: a request its quota rejects bans the id this long, on every rate
	// (0: no ban).
	Ban time.Duration
	// Hold: a request that would pass within this long is admitted for
	// that moment, and held until then (wait).
	Hold time.Duration
	// Returns: an admission may be given back (ReturnCall), so its
	// decision answers what that takes.
	Returns bool
	// Indexed: the rates are rendered per request; each id keeps an index
	// of the rate states it has, which Peek and Reset read.
	Indexed bool
}

// NewLimit makes the limits under prefix (no brace in it: the engine adds
// each id's hash tag), decided by a.
func NewLimit(prefix string, a Algorithm, o LimitOptions) *Limit { return newLimit(prefix, a, o) }

// Plan is the rates and cost a request is decided by, with what its
// decisions send made once (Limit.Plan).
type Plan struct {
	Rates []Rate // as the algorithm keeps them (its defaults filled in)
	Cost  int64
	// Over is the first rate whose capacity (n, or gcra's burst) is below
	// Cost, or -1: such a request can never pass.
	Over int

	argv  []any    // a decision's parameter set: cost, hold, ban, then each rate's arguments
	tails []string // each rate's state key after the id: "}" + its suffix
	id    string   // the rates' suffixes: tells plans apart
}

// Plan makes the plan of rates and cost.
func (l *Limit) Plan(rates []Rate, cost int64) *Plan { return l.plan(rates, cost) }

// ID tells plans of other rates apart (two plans of the same rates have
// the same ID).
func (p *Plan) ID() string { return p.id }

// Algorithm is the limit's algorithm.
func (l *Limit) Algorithm() Algorithm { return l.algo }

// BanKey is the Redis key of id's ban (it exists while the ban lasts).
func (l *Limit) BanKey(id string) string { return l.banKey(id) }

// KeysOf is the start of every Redis key of id: the local limiter forgets
// them all at once (Local.Forget).
func (l *Limit) KeysOf(id string) string { return l.keysOf(id) }

// Decisions.

// DecisionCall is the script call deciding one request of id by plan p:
// run it with Batcher.Do, then read it with Call.Decision.
func (l *Limit) DecisionCall(id string, p *Plan) *Call { return l.decisionCall(id, p) }

// ReturnCall is the script call giving back admission d of id by plan p
// (its answer did not count, or its client went away while held): run it
// with Batcher.Do. With a limit that Returns only.
func (l *Limit) ReturnCall(id string, p *Plan, d Decision) *Call { return l.returnCall(id, p, d) }

// Decision reads the answer of a decision call that Batcher.Do ran.
func (c *Call) Decision() (Decision, error) { return c.decision() }

// Done is closed once the call is answered.
func (c *Call) Done() <-chan struct{} { return c.done }

// Taken reports whether a worker took the call: then it is answered (Done)
// by its deadline, also when its caller stopped waiting; otherwise it never
// runs.
func (c *Call) Taken() bool { return c.state.Load() == callTaken }

// Decision is the outcome for one request.
type Decision struct {
	Allowed   bool
	Hold      time.Duration // admitted: how long to hold the request until its slot
	Wait      time.Duration // rejected: until the request would be admitted (0 = never)
	At        int64         // admitted: the time (µs, Redis TIME) it was recorded at
	Tight     int           // the rate reported in the RateLimit field
	Remaining int64         // of rate tight
	Reset     time.Duration // until rate tight's quota grows (0 = full)
	Ban       BanState      // rejected: whether by a ban (then Wait lasts until its end, or later, see BanLeft)
	// BanLeft: rejected under a ban that began before (Banned), until the
	// ban ends; Wait is later when the quota that started the ban admits
	// the request only after that.
	BanLeft time.Duration
	// Ordered: rejected, or rejected for longer than its quotas would, by
	// the order of a log (sliding_window): an admission another handler
	// holds until later comes first. Its slot may be given back at any
	// moment, so the rejection may not last.
	Ordered bool
	Cached  bool    // answered from the deny cache
	ans     []int64 // the script's answer (a return reads what gcra wrote)
}

// BanState says whether a rejection is a ban's (see Decision.Ban); the
// decision scripts answer it after a rejection's wait, as the constants
// BANNED and BAN_STARTED (decisionScript).
type BanState int64

const (
	NotBanned  BanState = iota // rejected by a rate, no ban
	Banned                     // rejected outright: the key is under a ban
	BanStarted                 // rejected by a rate, and so the ban starts now
)

// The batcher: the calls of one Redis client, in pipelines, behind a
// breaker.

const (
	// Workers is the pipelines in flight at once, per Redis client. One:
	// under load each then carries all that arrived during the last round
	// trip (one write, one read and one script call for all of them, on
	// Caddy's side and on Redis's; with 2, each carried half as many for
	// the same latency), and an idle worker still sends at once.
	Workers = 1
	// BreakerThreshold is the consecutive failures that open the breaker.
	BreakerThreshold = 3
)

// The batcher's own failures (besides Redis's errors).
var (
	ErrRedisTimeout = errors.New("redisdlm: redis did not answer within the timeout")
	ErrBreakerOpen  = errors.New("redisdlm: redis unreachable (circuit breaker open)")
	ErrBatcherDone  = errors.New("redisdlm: redis client closed")
	// ErrFailedRun answers a decision of a batch that failed once it had
	// begun recording (Redis refused a write, e.g. out of memory): it is
	// not sent again, so nothing is counted twice.
	ErrFailedRun error = answerError("redis_ratelimit: the decision failed while recording it (Redis refused a write, e.g. out of memory); not sent again")
)

// Client is what a Batcher needs of a Redis client (a *redis.Client,
// *redis.ClusterClient or *redis.Ring, or a test's wrapper of one that
// injects what a real Redis cannot, e.g. an answer lost after the write).
type Client interface {
	Pipeline() redis.Pipeliner
}

// Clock tells the time to what depends on it (the breaker's probes, the
// deny cache's expiry), so an engine test can move time without a sleep.
type Clock interface {
	Now() time.Time
}

// SystemClock is the real clock: time.Now.
type SystemClock struct{}

// Now is time.Now.
func (SystemClock) Now() time.Time { return time.Now() }

// ClockFunc is a Clock that calls f.
type ClockFunc func() time.Time

// Now calls f.
func (f ClockFunc) Now() time.Time { return f() }

// Options are a Batcher's settings.
type Options struct {
	// Workers is the pipelines in flight at once: Workers in production, 0
	// for a test that sends by hand (SendNow).
	Workers int
	// Logger returns the logger of the moment, for a worker's panic.
	// Default: slog.Default.
	Logger func() *slog.Logger
	// Clock times the breaker's probes. Default: SystemClock.
	Clock Clock
}

// Observer is told when the breaker opens and closes (the calling
// handler logs it: the batcher outlives configs, its log lines do not).
type Observer interface {
	// BreakerOpened: Redis failed consecutiveFailures times in a row;
	// calls are refused without Redis, probed about once per second.
	BreakerOpened(consecutiveFailures int)
	// BreakerClosed: a call succeeded while the breaker was open.
	BreakerClosed()
}

// NewBatcher starts o.Workers workers for client c.
func NewBatcher(c Client, o Options) *Batcher { return newBatcher(c, o) }

// Do runs one call through the breaker and the pipeline: refused at once
// while the breaker is open; otherwise its outcome (a Redis failure or an
// answer) is what the breaker counts. It waits at most timeout, or until
// ctx ends; a call given up before a worker took it never runs. obs is
// told of the breaker's changes (nil: nobody).
func (b *Batcher) Do(ctx context.Context, c *Call, timeout time.Duration, obs Observer) error {
	return b.do(ctx, c, timeout, obs)
}

// BreakerOpen reports whether the breaker is open now.
func (b *Batcher) BreakerOpen() bool { return b.breaker.open.Load() }

// Close stops the workers (the last handler using this client is gone).
// Waiting callers get ErrBatcherDone.
func (b *Batcher) Close() { b.close() }

// Stopped is closed once Close stopped the workers.
func (b *Batcher) Stopped() <-chan struct{} { return b.stop }

// SendNow sends calls as one pipeline at once, as a worker would, and
// answers each. For tests, on a batcher without workers.
func (b *Batcher) SendNow(calls []*Call) { b.sendNow(calls) }

// The deny cache: ids known to be rejected until a moment, answered without
// Redis.

// DenyEntry is one rejection remembered.
type DenyEntry struct {
	Until   time.Time // answer from memory before this (a little early)
	RetryAt time.Time // Retry-After points here (a little late)
	Tight   int       // the rate that rejects
	Left    int64     // its remaining quota when Redis rejected (less than cost)
	Cost    int64     // the rejected cost: only a request of this cost is answered here
	Banned  bool      // a ban: every request of the key is answered here, whatever its cost
	// Recheck: a ban kept across a Pub/Sub reconnect to the same Redis
	// process, during which a lift may have been missed: the key's next
	// request asks Redis, and is answered from here only when Redis cannot
	// answer (Kept).
	Recheck bool
}

// NewDenyCache makes a cache of at most max entries, on clock (nil:
// SystemClock); the entries' moments are of that clock. When full, it
// drops expired entries (at most once a second), else an arbitrary one.
func NewDenyCache(max int, clock Clock) *DenyCache { return newDenyCache(max, clock) }

// Get returns the entry of id if it still rejects a request of cost: only
// the same cost, unless it is a ban (a cheaper request may pass, and a
// costlier one passes later than RetryAt, so both ask Redis). A ban to be
// checked with Redis (Recheck) is not returned.
func (c *DenyCache) Get(id string, cost int64) (DenyEntry, bool) { return c.get(id, cost) }

// Put remembers a rejection of id (one already over is not kept).
func (c *DenyCache) Put(id string, e DenyEntry) { c.put(id, e) }

// Drop forgets id's entry, unless it is a ban.
func (c *DenyCache) Drop(id string) { c.drop(id) }

// Mark makes the cache a set of ids that expire: it reports whether id was
// not marked (or its mark was over), and marks it until then.
func (c *DenyCache) Mark(id string, until time.Time) bool { return c.mark(id, until) }

// Clear forgets every entry.
func (c *DenyCache) Clear() { c.clear() }

// Len is the number of entries.
func (c *DenyCache) Len() int { return c.len() }

// Forget drops id's entry, a ban too (an admin reset).
func (c *DenyCache) Forget(id string) { c.forget(id) }

// Announced holds a ban announced by an instance (AnnounceBan) until left
// from now, with Retry-After at retry.
func (c *DenyCache) Announced(id string, left, retry time.Duration) { c.announced(id, left, retry) }

// KeepBans forgets every entry but the bans that have not ended (a reset
// may have been missed while the Pub/Sub connection was down). With
// recheck (a reconnect to the same Redis process, which may have lifted a
// ban) every ban kept is to be checked with Redis; otherwise it returns
// the bans kept, under their keys of limit l, for a Redis process that
// lost them (WriteBackBans).
func (c *DenyCache) KeepBans(recheck bool, l *Limit) []KeptBan { return c.keepBans(recheck, l) }

// Kept returns id's ban if it is to be checked with Redis and has not
// ended: the answer while Redis cannot give one.
func (c *DenyCache) Kept(id string) (DenyEntry, bool) { return c.kept(id) }

// DropKept forgets id's ban if it is to be checked with Redis: Redis
// answered without it, so it was lifted meanwhile.
func (c *DenyCache) DropKept(id string) { c.dropKept(id) }

// Resets and bans across instances, over Pub/Sub.

// ForgetChannel is the Pub/Sub channel of admin resets and bans.
const ForgetChannel = "redisdlm:rl:forget"

// Publisher is what AnnounceBan needs of a Redis client.
type Publisher interface {
	Publish(ctx context.Context, channel string, message any) *redis.IntCmd
}

// Subscriber is what a ForgetListener needs of a Redis client.
type Subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// Pipeliner is what WriteBackBans needs of a Redis client.
type Pipeliner interface {
	Pipeline() redis.Pipeliner
}

// Forgetter is told what to forget and what to hold: one id of the limits
// under prefix to forget (a reset), one to hold as banned, and, after a
// resubscription (a reset may have been missed), everything to forget but
// the bans, knowing whether Redis runs a new process since the previous
// subscription.
type Forgetter interface {
	Forget(prefix, id string)
	Ban(prefix, id string, left, retry time.Duration)
	Resubscribed(newProcess bool)
}

// ListenForget starts listening on c until Close; f is told of each reset
// and ban. restarts counts the Redis processes c found replaced (it must be
// raised before a new connection's first command, as
// redisconn.Check.Restarts is). logger returns the logger of the moment,
// for a panic.
func ListenForget(c Subscriber, f Forgetter, restarts func() uint64, logger func() *slog.Logger) *ForgetListener {
	return listenForget(c, f, restarts, logger)
}

// Close stops the listener and waits for it.
func (l *ForgetListener) Close() { l.stop() }

// AnnounceBan tells every listening instance that id is banned: the ban
// ends in left, and a request may pass in retry (later when the quota that
// started the ban admits only then).
func (l *Limit) AnnounceBan(ctx context.Context, c Publisher, id string, left, retry time.Duration) error {
	return publishBan(ctx, c, l.prefix, id, left, retry)
}

// KeptBan is a ban an instance holds, to be written back to a Redis that
// may have lost it: its Redis key, when it ends and when its Retry-After
// points, from now.
type KeptBan struct {
	Key         string
	Left, Retry time.Duration
}

// WriteBackBans writes the bans an instance holds back to a Redis that may
// have lost them (a new process), in one pipeline: each ban key that is
// missing is set with the ban's remaining lifetime; one that is there (the
// ban was started again, or another instance wrote it back) is left as it
// is. It returns how many it set.
func WriteBackBans(ctx context.Context, c Pipeliner, bans []KeptBan) (int, error) {
	return writeBackBans(ctx, c, bans)
}

// The admin API: a quota read without counting, a ban, a reset.

// Admin is what Peek, PeekBan and Reset need of a Redis client.
type Admin interface {
	redisconn.Processor
	Publisher
	Pipeliner
}

// Quota is what Peek read of one id.
type Quota struct {
	States []RateState
	// Complete is false when the id's rate index lists more states than
	// are read (a thousand).
	Complete bool
}

// RateState is one rate of an id as Redis holds it.
type RateState struct {
	Key     string
	Rate    Rate
	Indexed bool // found in the id's rate index: a rate rendered per request
	Held    bool // Redis holds state for it
	Used    int64
	// Remaining and when it grows (0: full).
	Remaining int64
	Reset     time.Duration
}

// Peek reads the quota of id without counting a request: the state of each
// of rates (in their order) and, for an Indexed limit, of every rendered
// rate the id's index lists (sorted by key).
func (l *Limit) Peek(ctx context.Context, c Admin, id string, rates []Rate) (Quota, error) {
	return l.peek(ctx, c, id, rates)
}

// PeekBan reads id's ban: when it ends (Redis time) and how long it has
// left, or zero when id is not under a ban.
func (l *Limit) PeekBan(ctx context.Context, c Admin, id string) (until time.Time, left time.Duration, err error) {
	return l.peekBan(ctx, c, id)
}

// ResetResult is what Reset did.
type ResetResult struct {
	Keys     []string // the states read (as Peek would) and, with a ban, the ban's key
	Complete bool     // as Quota's
	Deleted  int64    // the keys Redis deleted
	// PublishErr: telling the other instances failed (their deny caches
	// forget id when its entry expires, their local limiters when its
	// windows pass).
	PublishErr error
}

// Reset deletes id's quota (as Peek finds it), its ban and its rate index,
// and tells every instance to forget id (ListenForget); it returns the
// error of the deletion.
func (l *Limit) Reset(ctx context.Context, c Admin, id string, rates []Rate) (ResetResult, error) {
	return l.reset(ctx, c, id, rates)
}

// The instances sharing a prefix.

// The heartbeats of the instances that share a prefix (fail_local's N).
const (
	// HeartbeatEvery is how often an instance records its heartbeat.
	HeartbeatEvery = time.Second
	// HeartbeatLife is how long a heartbeat lives, about three periods: an
	// instance that stops (or whose Redis link broke) no longer counts
	// after it.
	HeartbeatLife = 3 * HeartbeatEvery
)

// NewFleet keeps member's heartbeat among the instances sharing prefix, on
// a connection of its own taken from c.
func NewFleet(c redis.UniversalClient, prefix, member string) *Fleet {
	return &Fleet{client: c, key: fleetKey(prefix), member: member}
}

// FleetKey is the Redis key of the heartbeats under prefix.
func FleetKey(prefix string) string { return fleetKey(prefix) }

// Beat is what one heartbeat read.
type Beat struct {
	At        int64 // Redis TIME, µs
	Instances int64 // the instances with a live heartbeat
	Added     bool  // this beat added the instance to the set
	// Behind is the other instances whose latest heartbeat is not after
	// the joining moment given: those that have not counted this one yet.
	Behind int64
}

// Beat records the heartbeat and reads the fleet; joining is the Redis
// TIME (µs) of this instance's first beat that the others may not have
// counted yet (0: this beat's).
func (f *Fleet) Beat(ctx context.Context, joining int64) (Beat, error) { return f.beat(ctx, joining) }

// Close drops the fleet's connection.
func (f *Fleet) Close() { f.close() }

// The local limiter of fail_local.

// LocalRate is one rate of an id as the local limiter takes it
// (Limit.LocalRates).
type LocalRate struct {
	Key string // the rate's state key: its identity
	Rate
	algo Algorithm
}

// LocalRates are the rates of id in plan p as the local limiter takes them.
func (l *Limit) LocalRates(id string, p *Plan) []LocalRate { return l.localRates(id, p) }

// Share is the part of n (and burst) one of instances instances enforces:
// ceil(n ÷ instances), at least 1.
func Share(n, instances int64) int64 { return share(n, instances) }

// NewLocal makes a local limiter of at most max rates of keys; epoch is any
// moment before the first call (bucket numbers count from it).
func NewLocal(max int, epoch time.Time) *Local { return newLocal(max, epoch) }

// LocalDecision is the local limiter's answer.
type LocalDecision struct {
	Allowed   bool
	Wait      time.Duration // rejected: until it would be admitted (0 = never)
	Tight     int           // the rate reported (a rejecting one when rejected)
	Remaining int64         // of rate Tight, in its share
	Reset     time.Duration // until rate Tight's share grows (0 = full)
	Share     int64         // rate Tight's share of n
	// Full: rate Tight's key has no entry, and no room for one: the
	// limiter is full of charges that still matter. Not allowed; the
	// caller decides as if it could not decide at all.
	Full bool
}

// Admit decides a request of cost on every rate, each at its share for
// instances instances, and records it when every rate admits it, as a
// local admission to be charged to Redis.
func (l *Local) Admit(rates []LocalRate, cost, instances int64, now time.Time) LocalDecision {
	d, _ := l.admit(rates, cost, instances, now, true)
	return d
}

// Note records an admission that Redis decided, of cost on every rate (a
// rate with no room left is not noted).
func (l *Local) Note(rates []LocalRate, cost int64, now time.Time) { l.note(rates, cost, now) }

// Reservation is a place Reserve took in the share: when, and which
// entries held it (those made by then). The zero Reservation is none.
type Reservation struct {
	At  time.Time
	gen uint64
}

// IsZero reports whether r is no reservation.
func (r Reservation) IsZero() bool { return r.At.IsZero() }

// Reserve decides a request as Admit does, and records it when every rate
// admits it as an admission Redis is about to decide (nothing to charge):
// the cap of an instance back from local mode (the handler's), which also asks
// Redis. The Reservation is zero when a rate rejects.
func (l *Local) Reserve(rates []LocalRate, cost, instances int64, now time.Time) (LocalDecision, Reservation) {
	return l.admit(rates, cost, instances, now, false)
}

// Unreserve takes back a reservation of cost on rates (Redis did not admit
// the request).
func (l *Local) Unreserve(rates []LocalRate, cost int64, res Reservation) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.unreserve(rates, cost, res)
}

// Confirm turns a reservation of cost into an admission Redis decided,
// noted at now (as Note), in one step: no other call sees the share
// without it in between.
func (l *Local) Confirm(rates []LocalRate, cost int64, res Reservation, now time.Time) {
	l.confirm(rates, cost, res, now)
}

// Forget drops the state of every rate whose key starts with prefix
// (Limit.KeysOf: an admin reset of an id), charges included.
func (l *Local) Forget(prefix string) { l.forget(prefix) }

// Charge is admissions made locally in one bucket: the latest time, their
// sum of costs, and the charge's sequence number (unique in its limiter,
// ascending in a key's charges). A charge once taken is sealed: new
// admissions of its bucket make a charge of their own, since Redis may
// have applied the sealed one already.
type Charge struct {
	At     time.Time
	Cost   int64
	Seq    int64
	sealed bool
}

// ChargeBatch is what one rate's key is to be charged with.
type ChargeBatch struct {
	Rate    LocalRate
	Charges []Charge // ascending
	e       *localRate
	round   uint64 // e.round when taken
}

// Pending reports whether local admissions wait to be charged to Redis.
func (l *Local) Pending() bool { return l.pending() }

// PendingFor reports whether local admissions on any of these rates' keys
// wait to be charged, or are on their way.
func (l *Local) PendingFor(rates []LocalRate) bool { return l.pendingFor(rates) }

// TakeCharges hands over the local admissions to charge to Redis, one
// batch per rate's key, leaving none; those older than their rate's
// horizon at now are dropped. A key whose batch is on its way already is
// left for later. Charge them, or end each batch with Done or give it back
// with Untake.
func (l *Local) TakeCharges(now time.Time) []ChargeBatch { return l.takeCharges(now) }

// TakeFor is TakeCharges for these rates only; onTheirWay reports whether
// a batch of any of their keys was on its way already (Redis does not know
// all of them yet).
func (l *Local) TakeFor(rates []LocalRate, now time.Time) (batches []ChargeBatch, onTheirWay bool) {
	return l.takeFor(rates, now)
}

// Done ends a batch taken: Redis applied it (or refused it for good).
func (l *Local) Done(b ChargeBatch) { l.done(b) }

// Untake gives back a batch whose charge did not surely go through: it is
// sent again before the key's newer charges, and counts once.
func (l *Local) Untake(b ChargeBatch) { l.untake(b) }

// Recharge makes every admission the limiter counts within its rate's
// horizon at now, those Redis decided (Note) and its own, a charge again,
// in place of the charges pending: Redis restarted empty and lost them.
func (l *Local) Recharge(now time.Time) { l.recharge(now) }

// ChargeMarker is the Redis key where the charge script keeps the highest
// sequence number of this limiter it applied to the rate's key.
func (l *Local) ChargeMarker(key string) string { return l.chargeMarker(key) }

// ChargeOptions are how Charge sends its calls.
type ChargeOptions struct {
	// Offset is Redis TIME minus the local clock, µs: local admission
	// times become Redis times.
	Offset int64
	// Timeout bounds each call.
	Timeout time.Duration
	// Superseded, when set, is called before each call; the function it
	// returns is asked after the call: true ends the charge there with
	// ErrChargeSuperseded (e.g. Redis restarted meanwhile: the batches are
	// charged again by Recharge; nothing goes back).
	Superseded func() func() bool
}

// ChargeReport is what a Charge did.
type ChargeReport struct {
	Rates int   // the batches Redis applied
	Cost  int64 // their admissions' sum of costs
	// Dropped is the batches Redis refused for good (a key of another
	// type, an error in the script): dropped, not sent again; the first's
	// key and error.
	Dropped    int
	DroppedKey string
	DroppedErr error
}

// ErrChargeSuperseded ends a Charge whose ChargeOptions.Superseded said so.
var ErrChargeSuperseded = errors.New("redis_ratelimit: the charge of local admissions was superseded")

// Charge charges Redis with batches, one script call per rate's key, on c.
// Each charge is sent at most once per call and counts once in Redis
// however often it is sent (ChargeMarker). A batch whose call failed in a
// way that may pass next time (no answer, a connection lost, Redis
// loading, read-only in a failover, out of memory, busy) goes back with
// those after it (Untake), and that error is returned; one that Redis
// refused for good is dropped (ChargeReport.Dropped), and the others go
// on.
func (l *Local) Charge(ctx context.Context, c redisconn.Processor, batches []ChargeBatch, o ChargeOptions) (ChargeReport, error) {
	return l.charge(ctx, c, batches, o)
}

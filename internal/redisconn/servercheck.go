package redisconn

// The per-server checks, run on the first connection to each
// Redis server (never in Provision): the server's version must be at least
// minRedisVersion, and its maxmemory-policy must not evict keys. And on
// every new connection, the server's process: its run_id and when it
// started, so that a server restarted (possibly empty) is noticed before
// the first answer of the new process is used (see Check.Restarts and
// Check.Started).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// minRedisVersion is the oldest Redis the plugin runs on: the lock scripts
// declare script flags (a `#!lua` first line), which Redis 7.0 introduced,
// so that Redis refuses them up front when it is over maxmemory.
var minRedisVersion = [2]int{7, 0}

// recheckEvery is how long a server's verdict stands: a new connection to
// it after that checks again (a server upgraded or reconfigured in place).
const recheckEvery = time.Minute

// tooOldError refuses a connection to a server older than the minimum. It
// unwraps to nothing (go-redis hands the caller an OnConnect error's
// unwrapped cause, and this message must reach the caller whole).
type tooOldError struct{ msg string }

func (e *tooOldError) Error() string { return e.msg }

// errHelloUnparsed: HELLO answered without a version (e.g. a proxy).
var errHelloUnparsed = errors.New("redisdlm: HELLO answer without a version")

// serverState is what is known of one server.
type serverState struct {
	mu           sync.Mutex
	checked      time.Time
	err          error // not nil: the server is unusable (too old)
	evicting     bool
	configDenied bool // INFO was refused; warned once
	sentinel     bool // a Sentinel: it holds no keys
	runID        string
}

func (sc *Check) log() *slog.Logger {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return sc.logger()
}

// onConnect is the go-redis OnConnect hook: it checks the server behind cn
// unless it was checked less than recheckEvery ago, and refuses the
// connection when the server is unusable. Concurrent first connections to
// one server wait for one check.
func (sc *Check) onConnect(ctx context.Context, cn *redis.Conn) error {
	addr := connAddr(cn)
	if addr == "FailoverClient" {
		addr = sc.failover
	}
	sc.mu.Lock()
	st := sc.servers[addr]
	if st == nil {
		st = &serverState{}
		sc.servers[addr] = st
	}
	minVersion := sc.minVersion
	sc.mu.Unlock()

	st.mu.Lock()
	defer st.mu.Unlock()
	due := st.checked.IsZero() || time.Since(st.checked) >= recheckEvery
	if !due && (st.err != nil || st.sentinel || st.configDenied) {
		return st.err
	}
	// One round trip: HELLO for the version when a check is due, INFO
	// memory for the policy then, and INFO server for the process on every
	// new connection (INFO needs no access to the server's configuration;
	// not asked again once refused: each refusal is an ACL LOG entry).
	pipe := cn.Pipeline()
	var helloCmd *redis.Cmd
	var infoCmd *redis.StringCmd
	switch {
	case due && !st.configDenied:
		helloCmd, infoCmd = pipe.Do(ctx, "hello"), pipe.Info(ctx, "server", "memory")
	case due:
		helloCmd = pipe.Do(ctx, "hello")
	default:
		infoCmd = pipe.Info(ctx, "server")
	}
	cmds, _ := pipe.Exec(ctx)
	for _, cmd := range cmds {
		var re redis.Error
		if err := cmd.Err(); err != nil && !errors.As(err, &re) {
			return err // the call failed: this connection is not usable either
		}
	}
	if !due {
		if info, err := infoCmd.Result(); err == nil {
			sc.noteProcess(info, st)
		}
		return nil
	}
	version, mode, err := parseHello(helloCmd.Result())
	if mode == "sentinel" {
		// go-redis runs the hook on its connections to the Sentinels
		// too; they hold no keys.
		st.checked, st.err, st.sentinel = time.Now(), nil, true
		return nil
	}
	sc.checkVersion(version, err, addr, st, minVersion)
	if st.err == nil && infoCmd != nil {
		info, err := infoCmd.Result()
		sc.checkPolicy(info, err, addr, st)
		if err == nil {
			sc.noteProcess(info, st)
		}
	}
	st.checked = time.Now()
	return st.err
}

// noteProcess takes the server's process from an INFO server answer: a
// run_id other than the one seen before counts a restart, and the
// process's start is kept when it is the latest seen.
//
// INFO gives the uptime in whole seconds, floored from two floored
// clocks, so TIME − uptime can be up to a second before the real start;
// the start kept is a second later than that, so never before it (a
// reader refusing what predates the start refuses, at worst, what came in
// the process's first two seconds as well).
func (sc *Check) noteProcess(info string, st *serverState) {
	f := infoFields(info, "run_id", "uptime_in_seconds", "server_time_usec")
	up, err1 := strconv.ParseInt(f["uptime_in_seconds"], 10, 64)
	now, err2 := strconv.ParseInt(f["server_time_usec"], 10, 64)
	if f["run_id"] == "" || err1 != nil || err2 != nil {
		return
	}
	if st.runID != "" && st.runID != f["run_id"] {
		sc.restarts.Add(1)
	}
	st.runID = f["run_id"]
	start := now - up*1_000_000 + 1_000_000
	for {
		cur := sc.started.Load()
		if start <= cur || sc.started.CompareAndSwap(cur, start) {
			return
		}
	}
}

// infoFields picks the named fields of an INFO answer.
func infoFields(info string, names ...string) map[string]string {
	out := make(map[string]string, len(names))
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && slices.Contains(names, k) {
			out[k] = v
		}
	}
	return out
}

// checkVersion judges the server's version from its HELLO answer (HELLO
// is in the minimal ACL; Redis before 6.0 does not know the command) and
// sets st.err when it is too old.
func (sc *Check) checkVersion(version string, err error, addr string, st *serverState, minVersion [2]int) {
	var re redis.Error
	switch {
	case err != nil && errors.As(err, &re) && strings.HasPrefix(strings.ToUpper(re.Error()), "ERR UNKNOWN COMMAND"):
		version = "< 6.0"
	case err != nil:
		// Refused (e.g. NOPERM) or an odd answer: the version is unknown; go on.
		sc.log().Warn("cannot read the redis version; make sure the server runs Redis "+versionString(minVersion)+" or newer",
			slog.String("server", addr), slog.Any("error", err))
		st.err = nil
		return
	}
	if versionAtLeast(version, minVersion) {
		st.err = nil
		return
	}
	st.err = &tooOldError{fmt.Sprintf("redisdlm: redis at %s is version %s; redisdlm needs Redis %s or newer (its lock scripts use script flags)",
		addr, version, versionString(minVersion))}
	sc.log().Error("redis server too old; calls to it fail until it is upgraded",
		slog.String("server", addr), slog.String("redis_version", version),
		slog.String("required", versionString(minVersion)+" or newer"))
}

// checkPolicy judges maxmemory-policy from the INFO memory answer: an
// evicting policy can drop a held lock and its fencing counter and let two
// holders in.
func (sc *Check) checkPolicy(info string, err error, addr string, st *serverState) {
	if err != nil {
		// Refused by ACL, or INFO renamed or disabled (managed Redis).
		if !st.configDenied {
			st.configDenied = true
			sc.log().Warn("cannot read maxmemory-policy (INFO refused); locks need maxmemory-policy noeviction",
				slog.String("server", addr), slog.Any("error", err))
		}
		return
	}
	policy := infoFields(info, "maxmemory_policy")["maxmemory_policy"]
	evicting := strings.HasPrefix(policy, "allkeys-") || strings.HasPrefix(policy, "volatile-")
	if evicting {
		sc.log().Error("redis server evicts keys: it can drop a held lock and its fencing counter and let two holders in; set maxmemory-policy noeviction",
			slog.String("server", addr), slog.String("maxmemory_policy", policy))
	}
	if evicting != st.evicting {
		st.evicting = evicting
		sc.markEvicting(addr, evicting)
	}
}

func (sc *Check) close() {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for addr, st := range sc.servers {
		st.mu.Lock()
		if st.evicting {
			st.evicting = false
			sc.markEvicting(addr, false)
		}
		st.mu.Unlock()
	}
}

func (sc *Check) markEvicting(addr string, on bool) {
	if sc.onEvicting != nil {
		sc.onEvicting(sc, addr, on)
	}
}

// parseHello reads the version and mode ("standalone", "cluster" or
// "sentinel") from a HELLO answer; without arguments HELLO leaves the
// protocol as it is.
func parseHello(v any, err error) (version, mode string, _ error) {
	if err != nil {
		return "", "", err
	}
	fields := map[string]string{}
	switch m := v.(type) {
	case []any: // RESP2: a flat list of names and values
		for i := 0; i+1 < len(m); i += 2 {
			k, _ := m[i].(string)
			fields[k], _ = m[i+1].(string)
		}
	case map[any]any: // RESP3
		for k, x := range m {
			ks, _ := k.(string)
			fields[ks], _ = x.(string)
		}
	}
	if fields["version"] == "" {
		return "", "", fmt.Errorf("%w: %T", errHelloUnparsed, v)
	}
	return fields["version"], fields["mode"], nil
}

// versionAtLeast reports whether version ("7.0.15") is at least min.
// An unparsable version counts as too old.
func versionAtLeast(version string, min [2]int) bool {
	parts := strings.SplitN(version, ".", 3)
	if len(parts) < 2 {
		return false
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return false
	}
	return major > min[0] || major == min[0] && minor >= min[1]
}

func versionString(v [2]int) string { return fmt.Sprintf("%d.%d", v[0], v[1]) }

// connAddr is the host:port of the server behind cn (never with user
// info): go-redis names a connection "Redis<host:port db:n>".
func connAddr(cn *redis.Conn) string {
	s := strings.TrimPrefix(cn.String(), "Redis<")
	if i := strings.LastIndex(s, " db:"); i >= 0 {
		s = s[:i]
	}
	return strings.TrimSuffix(s, ">")
}

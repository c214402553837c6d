package redisdlm

// The lock side of the admin API: a lock key's state on every server and in
// this instance, and the force release. The lock engine is read through the
// accessors below only, as it changes often.

import (
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

var (
	//go:embed scripts/admin_lock_inspect.lua
	adminLockInspectLua string
	//go:embed scripts/admin_lock_release.lua
	adminLockReleaseLua string

	adminLockInspectScript = redisconn.NewScript(adminLockInspectLua)
	adminLockReleaseScript = redisconn.NewScript(adminLockReleaseLua)
)

// adminWakeFrom is the sender of the wake-up a force release publishes: no
// domain has this id, so every instance's waiters of the key are woken.
const adminWakeFrom = "admin"

// The lock engine, read through these accessors only (it changes often).

// lockClients returns the clients of the lock's servers, in config order.
func lockClients(h *RedisLock) []redis.UniversalClient { return h.locker.Clients() }

// lockInstanceID is this instance's id in the lock's Redis wait lists.
func lockInstanceID(h *RedisLock) string { return h.locker.InstanceID() }

// lockLocal counts this instance's waiters and holders of a Redis lock key,
// over every local queue that involves it (a key set holding it).
func lockLocal(h *RedisLock, redisKey string) (waiters, held int) { return h.locker.Local(redisKey) }

// lockWakeLocal wakes this instance's waiters of a Redis lock key.
func lockWakeLocal(h *RedisLock, redisKey string) { h.locker.WakeLocal(redisKey) }

// lockServerView is one server's state of a lock key.
type lockServerView struct {
	Server           string       `json:"server"`
	Error            string       `json:"error,omitempty"`
	HolderCount      int          `json:"holder_count"`
	Holders          []holderView `json:"holders"`
	FencingCounter   *int64       `json:"fencing_counter"`
	InstancesWaiting int          `json:"instances_waiting"`
	ThisInstanceWait bool         `json:"this_instance_waiting"`
	Replay           *replayView  `json:"replay"`
	// InDoubt: a run record (replay, an unsafe method) with no stored
	// answer and no live lease: its run may or may not have happened, so
	// duplicates are refused (409) until it ends or is cleared (DELETE
	// .../replay).
	InDoubt bool `json:"in_doubt"`
}

// holderView is one holder; its token is a secret (it releases the lock)
// and is never shown.
type holderView struct {
	LeaseLeftMs int64 `json:"lease_left_ms"`
}

// replayView is a response stored for replay under <lockkey>:replay, or
// a run record there (Format "run1", no Status).
type replayView struct {
	Status      *int   `json:"status"` // null when the stored form is not readable
	Size        int64  `json:"size"`   // of the body, or of the whole value when not readable
	StoredBytes int64  `json:"stored_bytes"`
	ExpiryMs    int64  `json:"expires_in_ms"`
	Format      string `json:"format,omitempty"` // the stored form's version, or the Redis type when not a string
}

// lockView is GET /redisdlm/locks/<handler>/<key>.
type lockView struct {
	Handler     string           `json:"handler"`
	Key         string           `json:"key"`
	RedisKey    string           `json:"redis_key"`
	Held        bool             `json:"held"` // a holder on a majority of servers
	WaitersHere int              `json:"waiters_here"`
	HeldHere    int              `json:"held_here"`
	Servers     []lockServerView `json:"servers"`
}

// fanOut runs f on every client in parallel, bounded by the handler's
// timeout per call.
func fanOut(ctx context.Context, clients []redis.UniversalClient, timeout time.Duration, f func(ctx context.Context, i int, c redis.UniversalClient)) {
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { _ = recover() }() // an admin call never takes Caddy down; its slot stays empty
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			f(cctx, i, c)
		}()
	}
	wg.Wait()
}

func lockTimeout(h *RedisLock) time.Duration {
	if h.Timeout > 0 {
		return time.Duration(h.Timeout)
	}
	return shared.DefaultTimeout
}

func (h *RedisLock) inspectLock(w http.ResponseWriter, r *http.Request, e *shared.AdminEntry, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty lock key")
	}
	rk := shared.StoredKey(h.Prefix, key)
	v := lockView{Handler: shared.HandlerRef(h.Name), Key: key, RedisKey: rk}
	v.WaitersHere, v.HeldHere = lockLocal(h, rk)
	clients := lockClients(h)
	v.Servers = make([]lockServerView, len(clients))
	found := v.WaitersHere > 0 || v.HeldHere > 0
	var mu sync.Mutex
	withHolders := 0
	fanOut(r.Context(), clients, lockTimeout(h), func(ctx context.Context, i int, c redis.UniversalClient) {
		sv := lockServerView{Server: e.ServerName(i), Holders: []holderView{}}
		res, err := adminLockInspectScript.Run(ctx, c,
			[]string{rk, lock.FenceKey(rk), lock.WaitqKey(rk), lock.ReplayKey(rk)}, lockInstanceID(h)).Slice()
		if err == nil {
			err = sv.fill(res)
		}
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			sv.Error = err.Error()
		} else {
			if sv.HolderCount > 0 {
				withHolders++
			}
			if sv.HolderCount > 0 || sv.FencingCounter != nil || sv.InstancesWaiting > 0 || sv.Replay != nil {
				found = true
			}
		}
		v.Servers[i] = sv
	})
	v.Held = withHolders >= len(clients)/2+1
	if !found {
		for _, s := range v.Servers {
			if s.Error != "" {
				return shared.AdminError(http.StatusBadGateway, "redis %s: %s", s.Server, s.Error)
			}
		}
		return shared.AdminError(http.StatusNotFound, "no lock state for key %q (Redis key %s)", key, rk)
	}
	return shared.WriteJSON(w, v)
}

// fill reads the inspect script's answer:
// {holders' lease left ms {..}, fence or "", waiting instances, this
// instance waiting 0|1, replay type, replay expiry ms, replay status or "",
// replay size, run record 0|1|2 (2: in doubt)}.
func (sv *lockServerView) fill(res []any) error {
	if len(res) != 9 {
		return fmt.Errorf("unexpected inspect answer of %d values", len(res))
	}
	left, _ := res[0].([]any)
	for _, l := range left {
		ms, _ := l.(int64)
		sv.Holders = append(sv.Holders, holderView{LeaseLeftMs: ms})
	}
	sv.HolderCount = len(sv.Holders)
	if s, _ := res[1].(string); s != "" {
		if f, err := strconv.ParseInt(s, 10, 64); err == nil {
			sv.FencingCounter = &f
		}
	}
	n, _ := res[2].(int64)
	sv.InstancesWaiting = int(n)
	me, _ := res[3].(int64)
	sv.ThisInstanceWait = me == 1
	if typ, _ := res[4].(string); typ != "none" && typ != "" {
		head, _ := res[6].(string)
		size, _ := res[7].(int64)
		sv.Replay = newReplayView(typ, head, size)
		sv.Replay.ExpiryMs, _ = res[5].(int64)
	}
	run, _ := res[8].(int64)
	sv.InDoubt = run == 2
	return nil
}

// newReplayView reads what it can of a stored answer from its first bytes
// (see storedAnswer.encode: "<format>\n<json head>\n<body>").
func newReplayView(typ, head string, size int64) *replayView {
	rv := &replayView{Size: size, StoredBytes: size, Format: typ}
	if head == "run1" {
		rv.Format, rv.Size = head, 0
		return rv
	}
	format, rest, ok := strings.Cut(head, "\n")
	if typ != "string" || !ok {
		return rv
	}
	js, _, ok := strings.Cut(rest, "\n")
	var a storedAnswer
	if !ok || json.Unmarshal([]byte(js), &a) != nil {
		return rv
	}
	rv.Format, rv.Status = format, &a.Status
	rv.Size = size - int64(len(format)+len(js)+2)
	return rv
}

// releaseLock force-releases every holder of a lock key on every server
// and wakes the key's waiters in every instance; with lock_delay, nobody
// gets the key for the delay. An old holder's next
// extension then finds its lease lost (the key's fencing counter is still
// there, so no extension re-creates the lease) and on_lost applies.
func (h *RedisLock) releaseLock(w http.ResponseWriter, r *http.Request, e *shared.AdminEntry, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty lock key")
	}
	rk := shared.StoredKey(h.Prefix, key)
	clients := lockClients(h)
	removed := make([]int64, len(clients))
	errs := make([]string, len(clients))
	fanOut(r.Context(), clients, lockTimeout(h), func(ctx context.Context, i int, c redis.UniversalClient) {
		n, err := adminLockReleaseScript.Run(ctx, c, []string{rk, lock.DelayKey(rk)}, lock.WakeChannel, adminWakeFrom+" "+lock.WakeID(rk),
			time.Duration(h.LockDelay).Milliseconds()).Int64()
		removed[i] = n
		if err != nil {
			errs[i] = err.Error()
		}
	})
	lockWakeLocal(h, rk)
	total := int64(0)
	type serverResult struct {
		Server  string `json:"server"`
		Removed int64  `json:"holders_removed"`
		Error   string `json:"error,omitempty"`
	}
	out := struct {
		Handler  string         `json:"handler"`
		Key      string         `json:"key"`
		RedisKey string         `json:"redis_key"`
		Servers  []serverResult `json:"servers"`
	}{Handler: shared.HandlerRef(h.Name), Key: key, RedisKey: rk}
	failed := 0
	for i := range clients {
		total += removed[i]
		if errs[i] != "" {
			failed++
		}
		out.Servers = append(out.Servers, serverResult{Server: e.ServerName(i), Removed: removed[i], Error: errs[i]})
	}
	if total == 0 {
		if failed > 0 {
			return shared.AdminError(http.StatusBadGateway, "releasing %q: %d of %d servers failed: %s", key, failed, len(clients), strings.Join(errs, "; "))
		}
		return shared.AdminError(http.StatusNotFound, "lock key %q (Redis key %s) is not held", key, rk)
	}
	if h.LockDelay > 0 {
		h.m.DelayForced.Inc()
	}
	h.logger.Warn("lock force-released through the admin API",
		zap.String("key", key), zap.Int64("holders_removed", total), zap.Int("servers_failed", failed))
	h.events.Emit(shared.EventLockForced, func() map[string]any { // through the target handler's own context
		return map[string]any{"handler": h.label, "key": shared.EventKey(key), "reason": "force-released through the admin API", "holders_removed": total}
	})
	return shared.WriteJSON(w, out)
}

// clearReplay deletes a lock key's run record and stored answer on every
// server: a key left in doubt (its run's outcome unknown) may be run again
// by the next request, and a stored answer is no longer replayed.
func (h *RedisLock) clearReplay(w http.ResponseWriter, r *http.Request, e *shared.AdminEntry, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty lock key")
	}
	rk := shared.StoredKey(h.Prefix, key)
	clients := lockClients(h)
	deleted := make([]int64, len(clients))
	errs := make([]string, len(clients))
	fanOut(r.Context(), clients, lockTimeout(h), func(ctx context.Context, i int, c redis.UniversalClient) {
		n, err := c.Del(ctx, lock.ReplayKey(rk)).Result()
		deleted[i] = n
		if err != nil {
			errs[i] = err.Error()
		}
	})
	total, failed := int64(0), 0
	for i := range clients {
		total += deleted[i]
		if errs[i] != "" {
			failed++
		}
	}
	if failed > 0 {
		return shared.AdminError(http.StatusBadGateway, "clearing the replay state of %q: %d of %d servers failed: %s", key, failed, len(clients), strings.Join(errs, "; "))
	}
	if total == 0 {
		return shared.AdminError(http.StatusNotFound, "no run record or stored answer for lock key %q (Redis key %s)", key, rk)
	}
	h.logger.Warn("replay state cleared through the admin API: the next request with the key runs the route", zap.String("key", key))
	return shared.WriteJSON(w, struct {
		Handler  string `json:"handler"`
		Key      string `json:"key"`
		RedisKey string `json:"redis_key"`
		Cleared  bool   `json:"cleared"`
	}{shared.HandlerRef(h.Name), key, rk, true})
}

// AdminKind, AdminName, AdminView and ServeAdmin are the handler's side of
// the admin API (internal/shared's registry, the redisadmin module).
func (h *RedisLock) AdminKind() string { return "redis_lock" }

func (h *RedisLock) AdminName() string { return h.Name }

func (h *RedisLock) AdminView(v *shared.HandlerView) { v.Prefix, v.Keys = h.Prefix, h.Keys }

// ServeAdmin answers GET .../<key> (the lock's state), POST
// .../<key>/release (force release) and DELETE .../<key>/replay (clear the
// run record and stored answer).
func (h *RedisLock) ServeAdmin(w http.ResponseWriter, r *http.Request, e *shared.AdminEntry, key, sub string) error {
	allowed := ""
	switch sub {
	case "":
		if r.Method == http.MethodGet {
			return h.inspectLock(w, r, e, key)
		}
		allowed = "GET (POST .../release frees the lock)"
	case "release":
		if r.Method == http.MethodPost {
			return h.releaseLock(w, r, e, key)
		}
		allowed = "POST"
	case "replay":
		if r.Method == http.MethodDelete {
			return h.clearReplay(w, r, e, key)
		}
		allowed = "DELETE"
	default:
		return shared.AdminError(http.StatusNotFound, "no such redisdlm admin resource %q; see GET /redisdlm/", r.URL.Path)
	}
	return shared.AdminError(http.StatusMethodNotAllowed, "method %s not allowed; use %s", r.Method, allowed)
}

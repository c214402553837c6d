package redislock

// The lock side of the admin API: the engine's answers (Inspect,
// ForceRelease, ClearReplay) as the admin API's JSON.

import (
	"encoding/json"
	"net/http"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/shared"
	"go.uber.org/zap"
)

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

func (h *RedisLock) inspectLock(w http.ResponseWriter, r *http.Request, e *shared.AdminEntry, key string) error {
	if key == "" {
		return shared.AdminError(http.StatusBadRequest, "empty lock key")
	}
	rk := shared.StoredKey(h.Prefix, key)
	v := lockView{Handler: shared.HandlerRef(h.Name), Key: key, RedisKey: rk}
	v.WaitersHere, v.HeldHere = h.locker.Local(rk)
	states := h.locker.Inspect(r.Context(), rk)
	v.Servers = make([]lockServerView, len(states))
	found := v.WaitersHere > 0 || v.HeldHere > 0
	withHolders := 0
	for i, st := range states {
		sv := newServerView(e.ServerName(i), st)
		if sv.Error == "" {
			if sv.HolderCount > 0 {
				withHolders++
			}
			if sv.HolderCount > 0 || sv.FencingCounter != nil || sv.InstancesWaiting > 0 || sv.Replay != nil {
				found = true
			}
		}
		v.Servers[i] = sv
	}
	v.Held = withHolders >= len(states)/2+1
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

// newServerView is one server's state as the admin API shows it.
func newServerView(server string, st lock.ServerState) lockServerView {
	sv := lockServerView{Server: server, Holders: []holderView{}}
	if st.Err != nil {
		sv.Error = st.Err.Error()
		return sv
	}
	for _, left := range st.LeaseLeft {
		sv.Holders = append(sv.Holders, holderView{LeaseLeftMs: left.Milliseconds()})
	}
	sv.HolderCount = len(sv.Holders)
	sv.FencingCounter = st.Fence
	sv.InstancesWaiting = st.InstancesWaiting
	sv.ThisInstanceWait = st.ThisInstanceWaiting
	if st.Stored != nil {
		sv.Replay = newReplayView(st.Stored)
	}
	sv.InDoubt = st.InDoubt
	return sv
}

// newReplayView reads what it can of a stored answer from its first bytes
// (see storedAnswer.encode: "<format>\n<json head>\n<body>").
func newReplayView(st *lock.Stored) *replayView {
	rv := &replayView{Size: st.Size, StoredBytes: st.Size, Format: st.Type, ExpiryMs: st.TTL.Milliseconds()}
	if st.Run {
		rv.Format, rv.Size = st.Head, 0
		return rv
	}
	format, rest, ok := strings.Cut(st.Head, "\n")
	if st.Type != "string" || !ok {
		return rv
	}
	js, _, ok := strings.Cut(rest, "\n")
	var a storedAnswer
	if !ok || json.Unmarshal([]byte(js), &a) != nil {
		return rv
	}
	rv.Format, rv.Status = format, &a.Status
	rv.Size = st.Size - int64(len(format)+len(js)+2)
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
	res := h.locker.ForceRelease(r.Context(), rk)
	total, failed, errs := tally(res)
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
	for i := range res {
		out.Servers = append(out.Servers, serverResult{Server: e.ServerName(i), Removed: res[i].Count, Error: errs[i]})
	}
	if total == 0 {
		if failed > 0 {
			return shared.AdminError(http.StatusBadGateway, "releasing %q: %d of %d servers failed: %s", key, failed, len(res), strings.Join(errs, "; "))
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
	res := h.locker.ClearReplay(r.Context(), rk)
	total, failed, errs := tally(res)
	if failed > 0 {
		return shared.AdminError(http.StatusBadGateway, "clearing the replay state of %q: %d of %d servers failed: %s", key, failed, len(res), strings.Join(errs, "; "))
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

// tally sums the engine's per-server removals: the count, the servers
// that failed, and each server's error text ("" for none).
func tally(res []lock.Removal) (total int64, failed int, errs []string) {
	errs = make([]string, len(res))
	for i, r := range res {
		total += r.Count
		if r.Err != nil {
			errs[i], failed = r.Err.Error(), failed+1
		}
	}
	return total, failed, errs
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

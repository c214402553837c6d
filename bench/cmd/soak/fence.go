package main

// The fencing tier (docs/fence.md's two tiers): requests on /f/ hold a
// redis_lock (single Redis) while they are at the checker, which plays the
// application: it writes to the storage through the /w/ route of a random
// Caddy, where redis_fence (single Redis) stands in front of the checker
// again, now playing the storage. Some writes go out while the lock is held
// ("in lease"); others after the request left or was cut off ("late": a
// write queued in an application, a holder whose lease was lost or whose
// client went away), usually after the next holder's write, with the lower
// token: the stale writes the fence exists for. The storage asserts that no
// stale write is stored:
//
//   - a write whose token is below that of a write the fence had surely
//     admitted before this one was sent (stored before it was sent, or
//     stamped X-Admitted right after the fence before it) is a stale write
//     stored (the fence had recorded the higher token before this write
//     reached it), a failure;
//   - a write below the highest token stored otherwise (both on their way
//     at once) is out of token order: the fence may have admitted them in
//     order and the later one overtook on the way to the storage ("stale
//     when it reaches the fence"), counted apart.

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// exReordered: see the package comment above.
const exReordered = "admitted in token order, overtaken on the way from the fence to the storage"

// fenceStats counts the writes of the fencing tier by kind and answer.
type fenceStats struct {
	sent   map[string]map[int]int // "in lease" | "late" → status (0: no answer) → writes
	stored int
}

// fenceKey is what the storage holds of one key: its writes in the order
// they were stored, with the highest token up to each, and each one's
// token and when the fence had surely admitted it.
type fenceKey struct {
	stored   []exitRec
	tokens   []int64
	admitted []int64 // Unix µs: X-Admitted (stamped right after the fence, ms) rounded up, at most the arrival
	max      int64
	maxAt    int64 // when the write with max was stored (Unix µs)
	maxBy    string
}

// admittedBefore is the highest token of the writes the fence had surely
// admitted before wall (Unix µs), or -1: those stored before it, and those
// stored later whose X-Admitted stamp is before it.
func (fk *fenceKey) admittedBefore(wall int64) int64 {
	best := maxBefore(fk.stored, wall)
	for i := len(fk.stored) - 1; i >= 0 && fk.stored[i].wall >= wall; i-- {
		if fk.admitted[i] < wall && fk.tokens[i] > best {
			best = fk.tokens[i]
		}
	}
	return best
}

// fenceWrite sends one write with tok to the storage through a random
// Caddy's fence and returns the answer's status (0: none).
func (c *checker) fenceWrite(key, tok, kind string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPut, c.fenceURL()+"/w/"+strings.TrimPrefix(key, "/f/"), nil)
	req.Header.Set("Lock-Fencing-Token", tok)
	req.Header.Set("X-Sent", strconv.FormatInt(time.Now().UnixMicro(), 10))
	req.Header.Set("X-Kind", kind)
	code := 0
	if resp, err := httpClient.Do(req); err == nil {
		resp.Body.Close()
		code = resp.StatusCode
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fence.sent[kind] == nil {
		c.fence.sent[kind] = map[int]int{}
	}
	c.fence.sent[kind][code]++
	switch code {
	case 0, http.StatusOK, http.StatusConflict, http.StatusServiceUnavailable:
	default: // no window excuses it (no backend)
		c.events = append(c.events, event{at: c.now(), what: "unexpected fence answer", key: key,
			detail: fmt.Sprintf("%s write with token %s: %d", kind, tok, code)})
	}
	return code
}

// holderWrite is the application's write for a request on /f/ that has
// held the lock for its X-Hold: sent now, while the lock is held, unless
// the request asks to write late (X-Late) or was cut off during the hold
// (on_lost cancel, its client went away, its Caddy died), which write 50 ms
// after they left. It returns the status for the request (the fence's 409,
// 503 when the fence could not say) and the delay of a late write.
func (c *checker) holderWrite(r *http.Request, key string) (int, time.Duration) {
	late, _ := time.ParseDuration(r.Header.Get("X-Late"))
	switch {
	case late > 0:
		return http.StatusOK, late
	case r.Context().Err() != nil:
		return http.StatusOK, 50 * time.Millisecond
	}
	done := make(chan int, 1)
	c.late.Add(1)
	go func() {
		defer c.late.Done()
		done <- c.fenceWrite(key, r.Header.Get("Lock-Fencing-Token"), "in lease")
	}()
	select {
	case code := <-done:
		if code == http.StatusOK || code == http.StatusConflict {
			return code, 0
		}
		return http.StatusServiceUnavailable, 0
	case <-r.Context().Done():
		// Cut off mid-write: the request leaves at once (as in the hold),
		// its write still on its way.
		return http.StatusOK, 0
	}
}

// lateWrite sends a write after the request left, in the background.
func (c *checker) lateWrite(key, tok string, after time.Duration) {
	c.late.Add(1)
	go func() {
		defer c.late.Done()
		time.Sleep(after)
		c.fenceWrite(key, tok, "late")
	}()
}

// store is the storage: it takes a write the fence let through.
func (c *checker) store(w http.ResponseWriter, r *http.Request) {
	key := "/f/" + strings.TrimPrefix(r.URL.Path, "/w/")
	tok, err := strconv.ParseInt(r.Header.Get("Lock-Fencing-Token"), 10, 64)
	sent, _ := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
	stamp, stampErr := strconv.ParseInt(r.Header.Get("X-Admitted"), 10, 64)
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now().UnixMicro()
	by := r.Header.Get("X-Kind") + " write via caddy" + r.Header.Get("X-Instance") + " admitted " + r.Header.Get("X-Admitted")
	c.fence.stored++
	fk := c.fenceKeys[key]
	if fk == nil {
		fk = &fenceKey{max: -1}
		c.fenceKeys[key] = fk
	}
	ev := func(what, detail string) {
		c.events = append(c.events, event{at: c.now(), what: what, backend: "fence", key: key, detail: detail})
	}
	switch before := fk.admittedBefore(sent); {
	case err != nil:
		ev("stale write stored", fmt.Sprintf("no fencing token (%q)", r.Header.Get("Lock-Fencing-Token")))
	case tok < before:
		ev("stale write stored", fmt.Sprintf("token %d (%s) below %d, admitted by the fence before this write was sent", tok, by, before))
	case tok < fk.max:
		ev("write out of token order", fmt.Sprintf("token %d (%s) below %d (%s), which was stored %.1fms after this write was sent (%.1fms ago)",
			tok, by, fk.max, fk.maxBy, float64(fk.maxAt-sent)/1e3, float64(now-fk.maxAt)/1e3))
	}
	if tok > fk.max {
		fk.max, fk.maxAt, fk.maxBy = tok, now, by
	}
	admitted := now
	if stampErr == nil {
		admitted = min(now, stamp*1000+1000)
	}
	fk.stored = append(fk.stored, exitRec{wall: now, maxTok: fk.max})
	fk.tokens, fk.admitted = append(fk.tokens, tok), append(fk.admitted, admitted)
	w.Write([]byte("ok"))
}

// fenceSummary is the report's line on the fencing tier's writes.
func (c *checker) fenceSummary() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var parts []string
	for _, kind := range []string{"in lease", "late"} {
		m := c.fence.sent[kind]
		parts = append(parts, fmt.Sprintf("%s: %d stored, %d refused 409, %d 503, %d no answer",
			kind, m[http.StatusOK], m[http.StatusConflict], m[http.StatusServiceUnavailable], m[0]))
	}
	return fmt.Sprintf("%d stored in all; %s", c.fence.stored, strings.Join(parts, "; "))
}

// fenceVacuous reports whether the fence refused none of many late writes:
// on hot keys most come after the next holder's write, so a fence that
// refuses none of them is not fencing.
func (c *checker) fenceVacuous() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, v := range c.fence.sent["late"] {
		n += v
	}
	return n >= 20 && c.fence.sent["late"][http.StatusConflict] == 0
}

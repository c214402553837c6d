package main

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"
)

// TestStoreClassifiesWrites: the storage of the fencing tier tells a stale
// write stored (below a token the fence had surely admitted before it was
// sent: stored by then, or stamped X-Admitted before it) from two writes
// on their way at once that arrived out of token order.
func TestStoreClassifiesWrites(t *testing.T) {
	now := time.Now().UnixMicro()
	type write struct {
		tok      int64
		sent     int64 // µs before now
		admitted int64 // X-Admitted, ms; 0 = none
	}
	ms := func(us int64) int64 { return (now + us) / 1000 }
	for _, tc := range []struct {
		name   string
		writes []write // in the order they arrive
		want   []string
	}{
		{"in token order", []write{{tok: 1, sent: -3000}, {tok: 2, sent: -2000}, {tok: 2, sent: -1000}, {tok: 3, sent: 0}}, nil},
		{"lower token sent after the higher was stored", []write{{tok: 5, sent: -60_000}, {tok: 4, sent: 1_000_000}}, []string{"stale write stored"}},
		{"both on their way at once", []write{{tok: 5, sent: -60_000}, {tok: 4, sent: -1_000_000}}, []string{"write out of token order"}},
		{"lower token sent after the higher's admission stamp", []write{{tok: 5, sent: -60_000, admitted: ms(-50_000)}, {tok: 4, sent: -20_000}}, []string{"stale write stored"}},
		{"lower token sent before the higher's admission stamp", []write{{tok: 5, sent: -60_000, admitted: ms(-10_000)}, {tok: 4, sent: -40_000}}, []string{"write out of token order"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &checker{start: time.Now(), fence: fenceStats{sent: map[string]map[int]int{}}, fenceKeys: map[string]*fenceKey{}}
			for _, w := range tc.writes {
				req := httptest.NewRequest(http.MethodPut, "/w/hot0", nil)
				req.Header.Set("Lock-Fencing-Token", strconv.FormatInt(w.tok, 10))
				req.Header.Set("X-Sent", strconv.FormatInt(now+w.sent, 10))
				if w.admitted > 0 {
					req.Header.Set("X-Admitted", strconv.FormatInt(w.admitted, 10))
				}
				c.store(httptest.NewRecorder(), req)
			}
			var got []string
			for _, e := range c.events {
				got = append(got, e.what)
				if e.key != "/f/hot0" || e.backend != "fence" {
					t.Errorf("event %+v: want key /f/hot0, backend fence", e)
				}
			}
			if len(got) != len(tc.want) || len(got) > 0 && got[0] != tc.want[0] {
				t.Errorf("events %q, want %q", got, tc.want)
			}
			if c.fence.stored != len(tc.writes) {
				t.Errorf("stored %d, want %d", c.fence.stored, len(tc.writes))
			}
		})
	}
}

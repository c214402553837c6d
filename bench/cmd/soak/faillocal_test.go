package main

import (
	"strconv"
	"testing"
	"time"
)

// TestFlCheck: the fail_local tier's checker holds the bound near an
// outage, Σ over instances of max(what Redis admitted through it in the
// window, share): it passes the local shares, uneven load before an
// outage, and n + (N−1)·share near a partial failure; it fails a window
// above the bound (an instance failing open while unreachable, an instance
// admitting its share on top of what Redis admitted through it, a restart
// empty that lets Redis admit n afresh), more than n decided by Redis, a
// whole window without admissions while unreachable, and more than n
// elsewhere.
func TestFlCheck(t *testing.T) {
	sec := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	// every admits k admissions per instance and second, from..to, each
	// decided within 2 ms.
	every := func(from, to float64, k int) []flAdmission {
		var as []flAdmission
		for at := from; at < to; at++ {
			for i := 0; i < 4; i++ {
				for j := 0; j < k; j++ {
					lo := sec(at) + time.Duration(i*k+j)*10*time.Millisecond
					as = append(as, flAdmission{lo: lo, hi: lo + 2*time.Millisecond, inst: strconv.Itoa(i)})
				}
			}
		}
		return as
	}
	burst := func(at float64, n int) []flAdmission {
		var as []flAdmission
		for j := 0; j < n; j++ {
			lo := sec(at) + time.Duration(j)*time.Millisecond
			as = append(as, flAdmission{lo: lo, hi: lo + 2*time.Millisecond, inst: strconv.Itoa(j % 4)})
		}
		return as
	}
	// through admits n admissions through the instances insts, at at.
	through := func(at float64, n int, insts ...int) []flAdmission {
		var as []flAdmission
		for j := 0; j < n; j++ {
			lo := sec(at) + time.Duration(j)*time.Millisecond
			as = append(as, flAdmission{lo: lo, hi: lo + 2*time.Millisecond, inst: strconv.Itoa(insts[j%len(insts)])})
		}
		return as
	}
	outage := flSpan{kind: fPause, full: true, from: sec(10), to: sec(13), back: flReturn}
	short := flSpan{kind: fPause, full: true, from: sec(10), to: sec(11), back: flReturn} // too short for the never-none check
	restart := flSpan{kind: fRestart, full: true, from: sec(10), to: sec(10.1), back: flRestartReturn}
	latency := flSpan{kind: fLatency, from: sec(10), to: sec(12), back: flReturn}
	cat := func(xs ...[]flAdmission) []flAdmission {
		var out []flAdmission
		for _, x := range xs {
			out = append(out, x...)
		}
		return out
	}
	for _, tc := range []struct {
		name  string
		adm   []flAdmission
		spans []flSpan
		slow  []flSpan // slow answers (maybe local) and the second after
		want  string   // the one kind of event, "" for none
	}{
		{"exact, no failure", every(0, 20, 5), nil, nil, ""},
		{"above n, no failure", cat(every(0, 5, 5), burst(6.0, 21)), nil, nil, "fleet limit"},
		{"above n after a slow answer", cat(every(0, 5, 5), burst(6.0, 25)), nil, []flSpan{{from: sec(5.9), to: sec(7.2)}}, ""},
		{"local shares while unreachable", every(0, 20, 5), []flSpan{outage}, nil, ""},
		{"failing open while unreachable", cat(every(0, 10, 5), burst(11.0, 60), every(12, 20, 5)), []flSpan{outage}, nil, "local limit"},
		{"none while unreachable", cat(every(0, 10.5, 5), every(12.6, 20, 5)), []flSpan{outage}, nil, "none admitted"},
		{"uneven before an outage", cat(through(9.5, 20, 0), through(10.2, 15, 1, 2, 3)), []flSpan{short}, nil, ""},
		{"a share on top of Redis's admissions", cat(through(9.5, 20, 0), through(10.2, 18, 1, 2, 3, 0, 1, 2)), []flSpan{short}, nil, "local limit"},
		{"Redis above n near an outage", cat(every(0, 8, 5), burst(9.1, 21)), []flSpan{short}, nil, "fleet limit"},
		{"restart empty, charged again", cat(burst(9.5, 20), every(11, 20, 5)), []flSpan{restart}, nil, ""},
		{"restart empty, n afresh", cat(burst(9.5, 20), burst(10.2, 20)), []flSpan{restart}, nil, "local limit"},
		{"near a partial failure", cat(every(0, 10, 5), burst(10.5, 35), every(12, 20, 5)), []flSpan{latency}, nil, ""},
		{"above n + (N−1)·share near a partial failure", cat(every(0, 10, 5), burst(10.5, 36), every(12, 20, 5)), []flSpan{latency}, nil, "fleet limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &soak{check: &checker{start: time.Now()}}
			s.check.fl = flState{adm: tc.adm, spans: tc.spans, localSeen: tc.slow}
			s.flCheck()
			kinds := map[string]bool{}
			for _, e := range s.check.events {
				kinds[e.what] = true
			}
			switch {
			case tc.want == "" && len(kinds) > 0:
				t.Errorf("events %v, want none (%+v)", kinds, s.check.events[0])
			case tc.want != "" && (len(kinds) != 1 || !kinds[tc.want]):
				t.Errorf("events %v, want only %q", kinds, tc.want)
			}
		})
	}
}

package ratelimit

import (
	"strconv"
	"strings"
	"time"
)

// A limit's keys and its decisions' script calls. Every key of a limit id
// shares one Cluster hash slot: <prefix>{<id>} and a tail, the rate's
// (its algorithm's suffix), ":ban" or ":rates".

// Limit is one handler's limits under a prefix (NewLimit).
type Limit struct {
	prefix string
	head   string // prefix + "{": a key is head + id + a tail
	algo   Algorithm
	o      LimitOptions
}

func newLimit(prefix string, a Algorithm, o LimitOptions) *Limit {
	return &Limit{prefix: prefix, head: prefix + "{", algo: a, o: o}
}

// plan makes the plan of rates (defaults filled in by the algorithm) and
// cost: its script arguments and its keys' tails, made once.
func (l *Limit) plan(rates []Rate, cost int64) *Plan {
	p := &Plan{Cost: cost, Over: -1, Rates: make([]Rate, len(rates)), tails: make([]string, len(rates))}
	p.argv = append(make([]any, 0, 3+3*len(rates)), cost, l.o.Hold.Microseconds(), l.o.Ban.Milliseconds())
	var id strings.Builder
	for i, r := range rates {
		r = l.algo.withDefaults(r)
		p.Rates[i] = r
		sfx := l.algo.suffix(r)
		id.WriteString(sfx)
		p.tails[i] = "}" + sfx
		p.argv = l.algo.args(p.argv, r)
		if cost > l.algo.capacity(r) && p.Over < 0 {
			p.Over = i
		}
	}
	p.id = id.String()
	return p
}

// keys appends the state keys of id's rates in plan p to buf.
func (l *Limit) keys(buf []string, id string, p *Plan) []string {
	for _, t := range p.tails {
		buf = append(buf, l.head+id+t)
	}
	return buf
}

// banKey is the key of id's ban: it exists, and expires, while the ban
// lasts.
func (l *Limit) banKey(id string) string { return l.head + id + "}:ban" }

// indexKey is the key of id's rate index, for a limit whose rates are
// rendered per request: a sorted set of the rate states id has, each scored
// by its expiry (ms), expiring with the latest (the decision script keeps
// it; Peek and Reset read it instead of scanning the keyspace).
func (l *Limit) indexKey(id string) string { return l.head + id + "}:rates" }

// keysOf is the start of every key of id.
func (l *Limit) keysOf(id string) string { return l.head + id + "}" }

// decisionCall is a decision's script call with room for the keys of a
// few rates: one allocation for both.
type decisionCall struct {
	Call
	keys [4]string
}

// decisionCall makes the script call deciding one request of id by plan p.
func (l *Limit) decisionCall(id string, p *Plan) *Call {
	dc := &decisionCall{}
	c := &dc.Call
	c.script, c.argv, c.keys = l.algo.decision(), p.argv, l.keys(dc.keys[:0], id, p)
	// Admissions never returned: the answer need not say what returning
	// one would take.
	c.lean = !l.o.Returns
	if l.o.Ban > 0 {
		c.banKey = l.banKey(id)
	}
	if l.o.Indexed {
		c.indexKey = l.indexKey(id)
	}
	return c
}

// returnCall makes the script call giving back admission d of id by plan p.
func (l *Limit) returnCall(id string, p *Plan, d Decision) *Call {
	c := &Call{keys: l.keys(make([]string, 0, len(p.tails)), id, p)}
	l.algo.returnCall(c, p, d)
	return c
}

// localRates are the rates of id in plan p as the local limiter takes them.
func (l *Limit) localRates(id string, p *Plan) []LocalRate {
	out := make([]LocalRate, len(p.Rates))
	for i, r := range p.Rates {
		out[i] = LocalRate{Key: l.head + id + p.tails[i], Rate: r, algo: l.algo}
	}
	return out
}

// parseRate reads "<n>/<window>" of a rate's suffix, with burst, as a rate
// a keeps; the caller checks that a writes the suffix back the same.
func parseRate(a Algorithm, s string, burst int64) (Rate, bool) {
	nText, wText, ok := strings.Cut(s, "/")
	if !ok {
		return Rate{}, false
	}
	n, err := strconv.ParseInt(nText, 10, 64)
	if err != nil {
		return Rate{}, false
	}
	w, err := time.ParseDuration(wText)
	if err != nil {
		return Rate{}, false
	}
	r := Rate{N: n, Window: w, Burst: burst}
	if a.CheckRate(r) != nil {
		return Rate{}, false
	}
	return r, true
}

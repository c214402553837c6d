package ratelimit

import (
	"slices"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

// Many decisions in one script call: the decision scripts
// (scripts/ratelimit_sliding.lua, scripts/ratelimit_gcra.lua) take a batch.
// The decisions that meet in one pipeline and use the same script (and, on a
// Cluster, the same hash slot) go as one call, which runs them one after the
// other, each exactly as its own call would (atomic over its rates, on Redis
// TIME plus its place in the batch in µs), and answers each on its own. One
// call instead of many saves Redis the per-call work (parsing, the KEYS and
// ARGV tables, TIME, the reply) and sends a limit's parameters once per call
// instead of once per decision. The answer is one flat array of integers,
// read without a value per element on either side.

// rlUnit is one command of a pipeline: a decision batch, or a call alone.
type rlUnit struct {
	calls []*Call
	batch bool // a decision batch (its answer is split among its calls)
}

// command is the unit's EVALSHA (or EVAL, with the script's text): for a
// batch, "evalsha", sha, keys (of each call its Keys, then its BanKey and
// its IndexKey if any), then D, S, the S parameter sets (each: its number
// of rates, its flags (1: it indexes, 2: lean answers), then the arguments
// its calls share) and, when S > 1, the set of each decision.
func (u *rlUnit) command(as sendAs) []any {
	c0 := u.calls[0]
	eval := as == byText
	if !u.batch {
		return append(c0.script.Head(eval, c0.keys, len(c0.argv)), c0.argv...)
	}
	keys := make([]string, 0, len(u.calls)*(len(c0.keys)+1))
	for _, c := range u.calls {
		keys = append(keys, c.keys...)
		if c.banKey != "" {
			keys = append(keys, c.banKey)
		}
		if c.indexKey != "" {
			keys = append(keys, c.indexKey)
		}
	}
	args := c0.script.Head(eval, keys, 2+len(u.calls)+2*(2+len(c0.argv)))
	args = append(args, len(u.calls), 0) // S is filled in below
	sIdx := len(args) - 1
	var sets []*Call // the first call of each set
	var idx []int
	for _, c := range u.calls {
		i := 0
		for i < len(sets) && !sameSet(sets[i], c) {
			i++
		}
		if i == len(sets) {
			sets = append(sets, c)
			flags := 0 // 1: it indexes; 2: lean answers
			if c.indexKey != "" {
				flags |= 1
			}
			if c.lean {
				flags |= 2
			}
			args = append(args, len(c.keys), flags)
			args = append(args, c.argv...)
		}
		idx = append(idx, i+1)
	}
	args[sIdx] = len(sets)
	if len(sets) > 1 {
		for _, i := range idx {
			args = append(args, i)
		}
	}
	return args
}

// batchOfOne is the command of one decision sent alone, as a batch of one,
// as the batcher sends it: with EVALSHA, and with EVAL and the script's
// text (for tests that run one decision).
func batchOfOne(c *Call) (evalsha, eval []any) {
	u := &rlUnit{calls: []*Call{c}, batch: true}
	return u.command(bySHA), u.command(byText)
}

// sameSet reports whether two calls share a parameter set: their
// arguments, whether they index, and whether their answers are lean.
func sameSet(a, b *Call) bool {
	return (a.indexKey == "") == (b.indexKey == "") && a.lean == b.lean && sameArgs(a.argv, b.argv)
}

// sameArgs reports whether two calls share their arguments: mostly the same
// plan's slice, else equal values (plans rendered per request).
func sameArgs(a, b []any) bool {
	if len(a) != len(b) {
		return false
	}
	return len(a) == 0 || &a[0] == &b[0] || slices.Equal(a, b)
}

// answer splits a batch's answer among its calls: 2 integers each, then a
// few per rate (PerRate). It reports whether the answer had the
// expected length.
func (u *rlUnit) answer(vals []int64) bool {
	n := 0
	for _, c := range u.calls {
		n += 2 + c.perRate()*len(c.keys)
	}
	if len(vals) != n {
		return false
	}
	for _, c := range u.calls {
		w := 2 + c.perRate()*len(c.keys)
		c.res, vals = vals[:w:w], vals[w:]
	}
	return true
}

// units groups a pipeline's calls: the decisions of one script (on a
// Cluster: of one hash slot as well) become one batch; any other call goes
// alone.
func units(batch []*Call, cluster bool) []*rlUnit {
	type group struct {
		script *redisconn.Script
		slot   int
	}
	idx := make(map[group]int, 4)
	out := make([]*rlUnit, 0, 4)
	for _, c := range batch {
		if decisionScripts[c.script] == 0 {
			out = append(out, &rlUnit{calls: []*Call{c}})
			continue
		}
		g := group{script: c.script}
		if cluster {
			g.slot = keySlot(c.keys[0])
		}
		i, ok := idx[g]
		if !ok {
			idx[g] = len(out)
			out = append(out, &rlUnit{calls: make([]*Call, 0, len(batch)), batch: true})
			i = len(out) - 1
		}
		out[i].calls = append(out[i].calls, c)
	}
	return out
}

// keySlot is the Redis Cluster hash slot of key (CRC16 of its hash tag).
func keySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for b := 0; b < 8; b++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

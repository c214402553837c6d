package redisdlm

import (
	"strings"

	"github.com/redis/go-redis/v9"
)

// Many decisions in one script call: the decisions that meet in one
// pipeline and use the same decision script (and, on a Cluster, the same
// hash slot) are sent as one call of that script's multi form, which runs
// them one after the other, each exactly as its own call would (atomic over
// its rates, on one Redis TIME per call), and answers each on its own. One
// call instead of many saves Redis the per-call work (parsing, KEYS/ARGV
// tables, the TIME call, the reply), which is most of a small decision.

// multiLoop runs the decisions of one multi call. ARGV[1] is their number;
// then, per decision, its key count, its argument count and its arguments;
// its keys follow each other in KEYS. Decision d runs at Redis TIME plus
// d-1 µs, as if the calls had come one after the other (a call takes more
// than a microsecond), so two decisions of one key never share a moment. A
// decision that fails (e.g. a key of the wrong type) is answered with its
// error; the others still run.
const multiLoop = `
local res = {}
local k, a = 1, 2
for d = 1, tonumber(ARGV[1]) do
	local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
	local ok, r = pcall(decide, {unpack(KEYS, k, k + nk - 1)}, {unpack(ARGV, a + 2, a + 1 + na)}, now0 + d - 1)
	if ok then
		res[d] = r
	elseif type(r) == 'table' then
		res[d] = r
	else
		res[d] = redis.error_reply(tostring(r))
	end
	k, a = k + nk, a + 2 + na
end
return res
`

// multiOf turns a decision script into its multi form: its body becomes the
// function decide(KEYS, ARGV, now), and Redis TIME is read once per call.
func multiOf(src string) *redis.Script {
	const clock = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000000 + tonumber(t[2])\n"
	if !strings.Contains(src, clock) {
		panic("redisdlm: a rate-limit script does not read TIME as the multi form expects")
	}
	body := strings.Replace(src, clock, "", 1)
	return redis.NewScript("local t = redis.call('TIME')\nlocal now0 = tonumber(t[1]) * 1000000 + tonumber(t[2])\n" +
		"local function decide(KEYS, ARGV, now)\n" + body + "\nend\n" + multiLoop)
}

var (
	slidingMultiScript = multiOf(slidingLua)
	gcraMultiScript    = multiOf(gcraLua)

	// multiForms maps each decision script to its multi form; other
	// scripts (returning an admission) are always sent alone.
	multiForms = map[*redis.Script]*redis.Script{
		slidingScript: slidingMultiScript,
		gcraScript:    gcraMultiScript,
	}
)

// rlUnit is one command of a pipeline: a call alone, or a multi call
// carrying several.
type rlUnit struct {
	calls  []*rlCall
	script *redis.Script // of a multi call
	keys   []string
	argv   []any
}

// args is the unit's EVALSHA command.
func (u *rlUnit) args() []any {
	if u.script == nil {
		return u.calls[0].args
	}
	args := make([]any, 0, 3+len(u.keys)+len(u.argv))
	args = append(args, "evalsha", u.script.Hash(), len(u.keys))
	for _, k := range u.keys {
		args = append(args, k)
	}
	return append(args, u.argv...)
}

// units groups a pipeline's calls: calls of one decision script (on a
// Cluster: of one hash slot as well) become one multi call; a call alone
// in its group stays a plain call.
func units(batch []*rlCall, cluster bool) []*rlUnit {
	type group struct {
		script *redis.Script
		slot   int
	}
	idx := make(map[group]int, 4)
	out := make([]*rlUnit, 0, len(batch))
	for _, c := range batch {
		multi := multiForms[c.script]
		if multi == nil {
			out = append(out, &rlUnit{calls: []*rlCall{c}})
			continue
		}
		g := group{script: multi}
		if cluster {
			g.slot = keySlot(c.keys[0])
		}
		i, ok := idx[g]
		if !ok {
			idx[g] = len(out)
			out = append(out, &rlUnit{calls: []*rlCall{c}, script: multi})
			continue
		}
		out[i].calls = append(out[i].calls, c)
	}
	for _, u := range out {
		if u.script == nil {
			continue
		}
		if len(u.calls) == 1 {
			u.script = nil
			continue
		}
		u.argv = append(make([]any, 0, 1+len(u.calls)*10), len(u.calls))
		for _, c := range u.calls {
			u.keys = append(u.keys, c.keys...)
			u.argv = append(u.argv, len(c.keys), len(c.argv))
			u.argv = append(u.argv, c.argv...)
		}
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

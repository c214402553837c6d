-- redis_ratelimit: the batch driver of the decision scripts. Redis scripts
-- cannot include each other, so Go (scripts.go) puts each decision script
-- together from the constants it names once (FAILED_READ, FAILED_RUN and
-- PER, the integers of an answer per rate), this file up to the body mark,
-- an algorithm's body (ratelimit_sliding.lua, ratelimit_gcra.lua), and the
-- rest of this file. One call decides a batch of requests, one after the
-- other, each checked for every rate of its limit before anything of it is
-- written.
--
-- ARGV[1]  D, the number of decisions; ARGV[2] S, the number of parameter
--          sets; then each set: r (its rates), c (the cost of a request,
--          1 <= c <= every rate's capacity), the longest hold in µs (wait),
--          then ARGN values per rate (the body's: see there); then, when
--          S > 1, the set of each decision (1..S).
-- KEYS     the keys of every decision in turn, one per rate of its set (the
--          body says what each holds).
--
-- The body defines ARGN, rates(s, r, a) (reads the r rates of set s from
-- ARGV[a] on) and decide() (decides the decision in hand: its set, its
-- first key - 1 in k, its first answer slot - 1 in o; it sets wrote before
-- its first write). Decision d runs at Redis TIME + d-1 µs (now), as if the
-- calls had come one after the other.
--
-- Returns, for each decision in turn, 2 + PER*r integers (the body says
-- which). In a batch, a decision that fails (a key of another type, a value
-- the script did not write, Redis refusing a write) answers FAILED_READ
-- when it wrote nothing, FAILED_RUN when it failed after writing, then
-- zeros, and the others still run; alone in its call (D = 1), it fails with
-- Redis's error instead.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local D, S = tonumber(ARGV[1]), tonumber(ARGV[2])
-- Of each parameter set: its rates, the cost of a request, the longest hold.
local R, COST, HOLD = {}, {}, {}
-- The decision in hand: its parameter set, first key - 1, first answer
-- slot - 1, and whether it wrote anything yet.
local out, o, k, set, wrote = {}, 0, 0, 1, false
-- @body
local a = 3
for s = 1, S do
	local r = tonumber(ARGV[a])
	R[s], COST[s], HOLD[s] = r, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
	rates(s, r, a + 3)
	a = a + 3 + ARGN * r
end

for d = 1, D do
	if S > 1 then
		set = tonumber(ARGV[a])
		a = a + 1
	end
	wrote = false
	if D == 1 then
		decide()
	elseif not pcall(decide) then
		out[o + 1], out[o + 2] = wrote and FAILED_RUN or FAILED_READ, 0
		for i = o + 3, o + 2 + PER * R[set] do
			out[i] = 0
		end
	end
	o, k, now = o + 2 + PER * R[set], k + R[set], now + 1
end
return out

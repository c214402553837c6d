-- redis_ratelimit: the batch driver of the decision scripts. Redis scripts
-- cannot include each other, so Go (scripts.go) puts each decision script
-- together from the constants it names once (FAILED_READ, FAILED_RUN, PER
-- the integers of an answer per rate, BANNED and BAN_STARTED), this file up
-- to the body mark,
-- an algorithm's body (ratelimit_sliding.lua, ratelimit_gcra.lua), and the
-- rest of this file. One call decides a batch of requests, one after the
-- other, each checked for every rate of its limit before anything of it is
-- written.
--
-- ARGV[1]  D, the number of decisions; ARGV[2] S, the number of parameter
--          sets; then each set: r (its rates), its flags (1: it indexes;
--          2: its answers are lean, the first 2 integers per rate only, for
--          a set whose admissions are never returned; 0: neither), c (the cost of a request, 1 <= c <= every rate's
--          capacity), the longest hold in µs (wait), the ban in ms (0:
--          none), then ARGN values per rate (the body's: see there); then,
--          when S > 1, the set of each decision (1..S).
-- KEYS     the keys of every decision in turn, one per rate of its set (the
--          body says what each holds), then, when its set bans, its ban key,
--          then, when its set indexes, its rate index.
--
-- A ban: a decision whose key is under a ban (its ban key exists; it
-- expires when the ban ends) is rejected outright, on every rate, without
-- reading them: it answers minus the µs until the ban ends (or, when the
-- quota's wait at the ban's start ends later, until then), BANNED, then
-- per rate -1 (no quota, rejecting), the µs until the ban ends, and zeros. A decision its
-- quota rejects (beyond what the hold absorbs; not one only a log's order
-- rejects) starts a ban: the ban key is set to expire in the set's ban,
-- holding the moment (µs) the request could pass (the later of the ban's
-- end and the quota's wait), and the answer is minus the µs until then,
-- BAN_STARTED, then what the body answered per rate (when Redis refuses
-- that write, the rejection stands without a ban).
--
-- A rate index (sets whose rates are rendered per request, so the admin API
-- finds a key's rates without a keyspace scan): a sorted set of the rate
-- keys an admission of the decision wrote, each scored by the moment (ms,
-- Redis time) its state expires (the body leaves it in EXP[i]). An
-- admission adds its rates with ZADD GT and moves the index's expiry on to
-- the latest of them with PEXPIREAT GT; only when a rate is new to the index
-- are its expired members trimmed and its expiry set to its latest member.
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
-- Of each parameter set: its rates, the cost of a request, the longest hold,
-- the ban (ms, as sent; 0: none), whether it indexes, and the keys of each
-- decision.
local R, COST, HOLD, BAN, INDEX, KEYN = {}, {}, {}, {}, {}, {}
-- Of each set: its answer's integers per rate (PER, or 2 when lean).
local PERS = {}
-- Per rate of the decision in hand, once the body admitted it: the moment
-- (ms) its state expires.
local EXP = {}
local unpackArgs = unpack -- before the body, which may name its own unpack
-- The decision in hand: its parameter set, first key - 1, first answer
-- slot - 1, and whether it wrote anything yet.
local out, o, k, set, wrote = {}, 0, 0, 1, false
-- The body may set decide1(call), the fast path of a decision of one rate
-- that neither bans nor indexes: it decides exactly as decide() would, with
-- call (redis.call alone in the call, which fails with Redis's error;
-- redis.pcall in a batch, so that no pcall per decision is needed), or
-- returns false having written nothing, for decide() to decide it; and
-- load1(s), which readies decide1 for the decisions of set s.
local decide1, load1
-- byQuota: the decision in hand, rejected, was rejected by a quota (not
-- only by the order of a log, see ratelimit_sliding.lua): only such a
-- rejection starts a ban. The body sets it false when not, and answers
-- ORDERED in the place of the ban state.
local byQuota = true
-- @body
local a = 3
for s = 1, S do
	local r = tonumber(ARGV[a])
	local flags = tonumber(ARGV[a + 1])
	INDEX[s], PERS[s] = flags % 2 == 1, flags >= 2 and 2 or PER
	R[s], COST[s], HOLD[s], BAN[s] = r, tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), ARGV[a + 4]
	KEYN[s] = r
	if BAN[s] ~= '0' then
		KEYN[s] = KEYN[s] + 1
	end
	if INDEX[s] then
		KEYN[s] = KEYN[s] + 1
	end
	rates(s, r, a + 5)
	a = a + 5 + ARGN * r
end

-- banning decides a decision of a set that bans (see the top). The ban
-- key holds the moment (µs) the request rejected when the ban began could
-- pass at the earliest: the end of the ban or, later, of its quota's wait;
-- a rejection under the ban reports the later of its end and that moment.
local function banning()
	local key = KEYS[k + R[set] + 1]
	local left = redis.call('PTTL', key)
	if left > 0 then
		local wait = left * 1000
		local until_ = tonumber(redis.call('GET', key) or '')
		if until_ and until_ - now > wait then
			wait = until_ - now
		end
		out[o + 1], out[o + 2] = -wait, BANNED
		local per = PERS[set]
		for p = o + 3, o + 2 + per * R[set], per do
			out[p], out[p + 1] = -1, left * 1000
			for j = p + 2, p + per - 1 do
				out[j] = 0
			end
		end
		return
	end
	byQuota = true
	decide()
	if out[o + 1] < 0 and byQuota then
		local wait = math.max(1000 * tonumber(BAN[set]), -out[o + 1])
		-- A Redis that refuses the write (out of memory) still rejects the
		-- request, only without a ban.
		local set_ = redis.pcall('SET', key, string.format('%d', now + wait), 'PX', BAN[set])
		if type(set_) == 'table' and set_.err then
			return
		end
		out[o + 1], out[o + 2] = -wait, BAN_STARTED
	end
end

-- indexing decides a decision of a set that indexes (see the top), and
-- records the rates of an admission in the index.
local function indexing()
	if BAN[set] ~= '0' then
		banning()
	else
		decide()
	end
	if out[o + 1] < 0 then
		return
	end
	local r, key = R[set], KEYS[k + KEYN[set]]
	local args, top = {}, 0
	for i = 1, r do
		args[2 * i - 1], args[2 * i] = string.format('%d', EXP[i]), KEYS[k + i]
		if EXP[i] > top then
			top = EXP[i]
		end
	end
	if redis.call('ZADD', key, 'GT', unpackArgs(args)) == 0 then
		-- Rates the index holds: it lives until the latest of them.
		redis.call('PEXPIREAT', key, string.format('%d', top), 'GT')
		return
	end
	-- A rate new to the index (or a new index): trim the expired members
	-- and expire it with its latest one.
	redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('(%d', math.floor(now / 1000)))
	local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', key, last[2])
end

local call = D == 1 and redis.call or redis.pcall
local loaded -- the set decide1 has loaded (load1)
for d = 1, D do
	if S > 1 then
		set = tonumber(ARGV[a])
		a = a + 1
	end
	local keyn, width = KEYN[set], 2 + PERS[set] * R[set]
	local fast = keyn == 1 and decide1
	if fast and loaded ~= set then
		load1(set)
		loaded = set
	end
	if fast and decide1(call) then
		-- Decided by the fast path.
	else
		local run = decide
		if INDEX[set] then
			run = indexing
		elseif keyn > R[set] then
			run = banning
		end
		if D == 1 then
			run()
		else
			wrote = false
			if not pcall(run) then
				out[o + 1], out[o + 2] = wrote and FAILED_RUN or FAILED_READ, 0
				for i = o + 3, o + width do
					out[i] = 0
				end
			end
		end
	end
	o, k, now = o + width, k + keyn, now + 1
end
return out

-- redis_ratelimit, algorithm gcra: the generic cell rate algorithm, the
-- body of a decision script (ratelimit_batch.lua is the batch around it; its
-- arithmetic, gcra_at, gcra_after and gcra_left, is ratelimit_gcra_step.lua,
-- in front of it).
--
-- ARGN = 3 values per rate: n, window w in µs, burst (1 <= c <= burst). A
--          request that every rate admits within the set's hold (wait) is
--          recorded as arriving at that future moment A and held until then.
-- KEYS     one per rate: the theoretical arrival time (TAT, µs, Redis TIME)
--          of that rate. Once an admission was returned on a key
--          (ratelimit_gcra_return.lua), its value is "TAT S X" and its last
--          few returns: S the µs returned so far, X the latest expiry (ms)
--          any TAT of the key required (see there); each admission then
--          keeps them and expires the key at X at the earliest (the returns
--          go once the key's schedule drained). A plain "TAT" costs no
--          parsing.
--
-- One unit costs T = w/n; a request of cost c is admitted at A when
-- TAT + c*T - burst*T is not after A. So at most burst + t*n/w units pass in
-- any interval t.
--
-- Answers, per decision: the hold in µs when admitted (>= 0), else minus the
-- µs until it would be admitted; A (0 when rejected); then PER = 4 per rate:
-- remaining quota (also when this request costs more than it; -(remaining+1)
-- for a rate that rejects the request), µs until it grows (0 = full; for a
-- rate that rejects the request, until it would pass), the TAT this
-- admission wrote, in whole µs (0 when rejected), and the key's S then (0
-- for a plain TAT), by which ratelimit_gcra_return.lua knows how much of
-- this admission is still in the schedule (a set with lean answers: the
-- first two only). A decision fails on a key of another type or a value
-- that is not a TAT.
local ceil, floor, fmt = math.ceil, math.floor, string.format
local ARGN = 3

-- Each parameter set's rates: unit T, tolerance burst*T, burst.
local UNIT, TAU, BURST = {}, {}, {}
local function rates(s, r, a)
	local u, tau, b = {}, {}, {}
	for i = 1, r do
		local n, w, burst = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
		u[i], b[i] = w / n, burst
		tau[i] = burst * u[i]
		a = a + 3
	end
	UNIT[s], TAU[s], BURST[s] = u, tau, b
end

-- Per rate of the decision in hand (made by the first decide(): decide1
-- needs none).
local tats, ats, sums, exps, lists

-- pxat formats an expiry (ms) as an integer; the decisions of a call
-- mostly expire in the same millisecond, so the last one is kept.
local lastPX, lastPXS = nil, nil
local function pxat(ms)
	if ms ~= lastPX then
		lastPX, lastPXS = ms, fmt('%d', ms)
	end
	return lastPXS
end

local function decide()
	local r, cost, maxwait = R[set], COST[set], HOLD[set]
	local u, tau, burst = UNIT[set], TAU[set], BURST[set]
	if not tats then
		tats, ats, sums, exps, lists = {}, {}, {}, {}, {}
	end
	-- The earliest moment A every rate admits the request.
	local A = now
	for i = 1, r do
		local v = redis.call('GET', KEYS[k + i])
		local tat, sum, x, list = now, false, 0, ''
		if v then
			tat = tonumber(v)
			if not tat then
				local ts, ss, xs, rest = string.match(v, '^(%S+) (%d+) (%d+)(.*)$')
				tat, sum, x, list = tonumber(ts), tonumber(ss), tonumber(xs), rest
			end
			if tat < now then
				-- Drained: the admissions the returns were kept for
				-- have nothing left to give back.
				tat, list = now, ''
			end
		end
		local at = gcra_at(tat, cost, u[i], tau[i])
		tats[i], ats[i], sums[i], exps[i], lists[i] = tat, at, sum, x, list
		if at > A then
			A = at
		end
	end
	local hold = ceil(A - now)
	local admit = hold <= maxwait
	if admit then
		out[o + 1], out[o + 2] = hold, ceil(A)
	else
		out[o + 1], out[o + 2] = -math.max(1, hold - maxwait), 0
	end
	local per = PERS[set]
	for i = 1, r do
		local tat, ui, p, sum = tats[i], u[i], o + 3 + per * (i - 1), sums[i]
		if admit then
			tat = gcra_after(tat, A, cost, ui)
			-- The state matters until the TAT is in the past. Whole
			-- numbers are formatted as integers (a double's %.17g
			-- costs Redis several times more).
			local v = tat
			if tat == floor(tat) then
				v = fmt('%d', tat)
			end
			local px = ceil(tat / 1000)
			wrote = true
			if sum then
				-- Returns happened: the key lives until X at least.
				if exps[i] > px then
					px = exps[i]
				end
				if v == tat then
					v = fmt('%.17g', tat)
				end
				v = fmt('%s %d %d%s', v, sum, px, lists[i])
			end
			redis.call('SET', KEYS[k + i], v, 'PXAT', pxat(px))
			EXP[i] = px
			if per == 4 then
				out[p + 2] = floor(tat)
			end
		elseif per == 4 then
			out[p + 2] = 0
		end
		if per == 4 then
			out[p + 3] = sum or 0
		end
		local rem, grows = gcra_left(tat, now, ui, tau[i], burst[i])
		if not admit and ats[i] - now > maxwait then
			-- A rate that rejects: its quota as -(rem+1), so the caller
			-- reports a rejecting rate in the RateLimit field.
			out[p], out[p + 1] = -rem - 1, ceil(ats[i] - now)
		else
			out[p], out[p + 1] = rem, grows
		end
	end
end

-- decide1 is decide() for a set of one rate that neither bans nor indexes,
-- on a key without returns (a plain TAT, or none): the same steps and
-- arithmetic, without the tables of many rates (ratelimit_batch.lua).
local U1, TAU1, BURST1, COST1, HOLD1, FULL1 -- of the set load1 readied
function load1(s)
	U1, TAU1, BURST1, HOLD1 = UNIT[s][1], TAU[s][1], BURST[s][1], HOLD[s]
	COST1, FULL1 = COST[s], PERS[s] == 4
end

function decide1(call)
	local key = KEYS[k + 1]
	local v = call('GET', key)
	local tat = now
	if v then
		-- An error (in a batch), returns or no TAT: decide() decides.
		tat = tonumber(v)
		if not tat then
			return false
		end
		if tat < now then
			tat = now
		end
	end
	local at = gcra_at(tat, COST1, U1, TAU1)
	local A = now
	if at > A then
		A = at
	end
	local hold = ceil(A - now)
	local admit = hold <= HOLD1
	if admit then
		tat = gcra_after(tat, A, COST1, U1)
		local v = tat
		if tat == floor(tat) then
			v = fmt('%d', tat)
		end
		wrote = true
		local ok = call('SET', key, v, 'PXAT', pxat(ceil(tat / 1000)))
		if ok.err then
			out[o + 1], out[o + 2], out[o + 3], out[o + 4] = FAILED_RUN, 0, 0, 0
			if FULL1 then
				out[o + 5], out[o + 6] = 0, 0
			end
			return true
		end
		out[o + 1], out[o + 2] = hold, ceil(A)
		if FULL1 then
			out[o + 5], out[o + 6] = floor(tat), 0
		end
	else
		out[o + 1], out[o + 2] = -math.max(1, hold - HOLD1), 0
		if FULL1 then
			out[o + 5], out[o + 6] = 0, 0
		end
	end
	local rem, grows = gcra_left(tat, now, U1, TAU1, BURST1)
	if not admit and at - now > HOLD1 then
		out[o + 3], out[o + 4] = -rem - 1, ceil(at - now)
	else
		out[o + 3], out[o + 4] = rem, grows
	end
	return true
end

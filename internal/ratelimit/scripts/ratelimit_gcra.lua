-- redis_ratelimit, algorithm gcra: the generic cell rate algorithm. One call
-- decides a batch of requests, one after the other, each checked for every
-- rate of its limit before anything of it is written.
--
-- ARGV[1]  D, the number of decisions; ARGV[2] S, the number of parameter
--          sets; then each set: r (its rates), c (the cost of a request,
--          1 <= c <= every rate's burst), the longest hold in µs (wait: a
--          request that every rate admits within it is recorded as arriving
--          at that future moment A and held until then), then per rate
--          n, window w in µs, burst; then, when S > 1, the set of each
--          decision (1..S).
-- KEYS     the keys of every decision in turn, one per rate of its set: the
--          theoretical arrival time (TAT, µs, Redis TIME) of that rate. Once
--          an admission was returned on a key (ratelimit_gcra_return.lua),
--          its value is "TAT S X" and its last few returns: S the µs
--          returned so far, X the latest expiry (ms) any TAT of the key
--          required (see there); each admission then keeps them and expires
--          the key at X at the earliest (the returns go once the key's
--          schedule drained). A plain "TAT" costs no parsing.
--
-- One unit costs T = w/n; a request of cost c is admitted at A when
-- TAT + c*T - burst*T is not after A. So at most burst + t*n/w units pass in
-- any interval t. Decision d runs at Redis TIME + d-1 µs, as if the calls had
-- come one after the other.
--
-- Returns, for each decision in turn: the hold in µs when admitted (>= 0),
-- else minus the µs until it would be admitted; A (0 when rejected); then for
-- each rate: remaining quota (also when this request costs more than it;
-- -(remaining+1) for a rate that rejects the request), µs until it grows
-- (0 = full; for a rate that rejects the request, until it would pass),
-- the TAT this admission wrote, in whole µs (0 when rejected), and the
-- key's S then (0 for a plain TAT), by which ratelimit_gcra_return.lua
-- knows how much of this admission is still in the schedule. In a batch, a
-- decision that fails (a key of another type, a value that is not a TAT)
-- answers -2^62 when it wrote nothing, -2^61 when it failed after writing a
-- rate's TAT, and the others still run; alone in its call (D = 1), it fails
-- with Redis's error instead.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local D, S = tonumber(ARGV[1]), tonumber(ARGV[2])
local ceil, floor, fmt = math.ceil, math.floor, string.format

-- The parameter sets, with each rate's unit T and tolerance burst*T.
local R, COST, HOLD, UNIT, TAU, BURST = {}, {}, {}, {}, {}, {}
local a = 3
for s = 1, S do
	local r = tonumber(ARGV[a])
	R[s], COST[s], HOLD[s] = r, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
	a = a + 3
	local u, tau, b = {}, {}, {}
	for i = 1, r do
		local n, w, burst = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
		u[i], b[i] = w / n, burst
		tau[i] = burst * u[i]
		a = a + 3
	end
	UNIT[s], TAU[s], BURST[s] = u, tau, b
end

-- The decision in hand: its parameter set, first key - 1, first answer
-- slot - 1, and whether it wrote anything yet.
local out, o, k, set, wrote = {}, 0, 0, 1, false
local tats, ats, sums, exps, lists = {}, {}, {}, {}, {}

local function decide()
	local r, cost, maxwait = R[set], COST[set], HOLD[set]
	local u, tau, burst = UNIT[set], TAU[set], BURST[set]
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
		local at = tat + cost * u[i] - tau[i]
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
	for i = 1, r do
		local tat, ui, p, sum = tats[i], u[i], o + 4 * i - 1, sums[i]
		if admit then
			if A > tat then
				tat = A
			end
			tat = tat + cost * ui
			-- The state matters until the TAT is in the past. Whole
			-- numbers are formatted as integers (a double's %.17g
			-- costs Redis several times more).
			local v = tat
			if tat == floor(tat) then
				v = fmt('%d', tat)
			end
			local pxat = ceil(tat / 1000)
			wrote = true
			if sum then
				-- Returns happened: the key lives until X at least.
				if exps[i] > pxat then
					pxat = exps[i]
				end
				if v == tat then
					v = fmt('%.17g', tat)
				end
				v = fmt('%s %d %d%s', v, sum, pxat, lists[i])
			end
			redis.call('SET', KEYS[k + i], v, 'PXAT', fmt('%d', pxat))
			out[p + 2] = floor(tat)
		else
			out[p + 2] = 0
		end
		out[p + 3] = sum or 0
		local debt = tat - now
		-- Half a microsecond of slack absorbs the rounding of µs-sized doubles.
		local rem = floor((tau[i] - debt + 0.5) / ui)
		if rem < 0 then
			rem = 0
		end
		out[p] = rem
		if not admit and ats[i] - now > maxwait then
			-- A rate that rejects: its quota as -(rem+1), so the caller
			-- reports a rejecting rate in the RateLimit field.
			out[p], out[p + 1] = -rem - 1, ceil(ats[i] - now)
		elseif rem >= burst[i] then
			out[p + 1] = 0
		else
			out[p + 1] = math.max(1, ceil(debt - tau[i] + (rem + 1) * ui))
		end
	end
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
		out[o + 1], out[o + 2] = wrote and -2305843009213693952 or -4611686018427387904, 0
		for i = o + 3, o + 2 + 4 * R[set] do
			out[i] = 0
		end
	end
	o, k, now = o + 2 + 4 * R[set], k + R[set], now + 1
end
return out

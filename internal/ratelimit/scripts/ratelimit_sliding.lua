-- redis_ratelimit, algorithm sliding_window: an exact sliding log, the body
-- of a decision script (ratelimit_batch.lua is the batch around it).
--
-- ARGN = 2 values per rate: n, window w in µs (1 <= c <= n). A request that
--          every rate admits within the set's hold (wait) is recorded at
--          that future moment and held until then.
-- KEYS     one per rate: the log of that rate, a string of 8-byte
--          big-endian doubles: a 24-byte header {pos, lo, last}, then a
--          ring of n slots.
--          pos  counts the slots ever written to the log; slot number j is
--               in ring slot j % n, so the ring holds the last n, the oldest
--               at ring slot pos % n. Times (µs, Redis TIME) never decrease;
--               one admission of cost c writes c slots with one time, and
--               two admissions never share a time.
--          lo   the first slot that was within the window at the last
--               write (a hint for counting the remaining quota).
--          last the time of the latest admission.
--
-- Rate i admits c at time T when its (n-c+1)-th latest slot is older than
-- T - w. Then no closed interval of length w ever holds more than n slots.
-- The request is recorded (in every log, at one time T) only when every
-- rate admits it within the hold.
--
-- The log is read with GETRANGE: its first PRE bytes (the header and the
-- first slots) in one call, other slots 8 bytes at a time, or a few at once
-- where the search steps through them (copying the whole log into Lua costs
-- more, already at a few hundred slots). A log shorter than PRE bytes is
-- then known whole and written back with one SET (value and expiry); a
-- longer one with SETRANGEs and a PEXPIREAT. O(1) calls per request in the
-- steady state; 2 (GETRANGE, SET) for a short log, and one TIME per call.
--
-- Answers, per decision: the hold in µs when admitted (>= 0), else minus
-- the µs until it would be admitted; T (0 when rejected); then PER = 2 per
-- rate: remaining quota (also when this request costs more than it;
-- -(remaining+1) for a rate that rejects the request), µs until it grows
-- (0 = full; for a rate that rejects the request, until it would pass). A
-- decision fails on a key of another type or a value that is not a log.
local HDR = 24
local PRE = 256 -- bytes read first: the header and slots 0..28
local STEP = 4 -- slots stepped through from the hint before a binary search
-- Numbers go to Redis as strings formatted here as integers: Redis formats
-- a Lua number as a double (%.17g), which costs several times more.
local PRE1 = string.format('%d', PRE - 1)
local fmt = string.format
local unpack, pack, max, min = struct.unpack, struct.pack, math.max, math.min
local ARGN = 2

-- slot reads slot j of the log at key k: from v (its first bytes), from c
-- (bytes read from offset co), else from Redis.
local function slot(k, v, c, co, j)
	local off = HDR + 8 * j
	if off + 8 <= #v then
		return (unpack('>d', v, off + 1))
	end
	if c and off >= co and off + 8 <= co + #c then
		return (unpack('>d', c, off - co + 1))
	end
	return (unpack('>d', redis.call('GETRANGE', k, fmt('%d', off), fmt('%d', off + 7))))
end

-- splice puts x at byte off of b (padding b with zero bytes up to off).
local function splice(b, off, x)
	if #b < off then
		b = b .. string.rep('\0', off - #b)
	end
	return string.sub(b, 1, off) .. x .. string.sub(b, off + #x + 1)
end

-- Each parameter set's rates: n and w.
local N, W = {}, {}
local function rates(s, r, a)
	local n, w = {}, {}
	for i = 1, r do
		n[i], w[i] = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
		a = a + 2
	end
	N[s], W[s] = n, w
end

-- Per rate of the decision in hand: its first bytes, header, and the
-- moment it admits the request.
-- Per rate of the decision in hand: its log's first bytes, pos, lo, last;
-- the moment it would admit the request (AT: after its quota allows it and
-- after the log's latest admission, QAT: after its quota allows it).
local V, POS, LO, LAST, AT, QAT = {}, {}, {}, {}, {}, {}
-- The last expiry formatted (ms): the decisions of a call mostly expire in
-- the same millisecond.
local lastExp, lastExpS = nil, nil

local function decide()
	local r, cost, maxwait, ns, ws = R[set], COST[set], HOLD[set], N[set], W[set]
	-- The earliest moment T every rate admits the request: not before now,
	-- after every log's latest admission (times stay unique), and after each
	-- rate's (n-c+1)-th latest slot has left its window.
	local T = now
	for i = 1, r do
		local key, n = KEYS[k + i], ns[i]
		local v = redis.call('GETRANGE', key, '0', PRE1)
		local pos, lo, last = 0, 0, nil
		if #v >= HDR then
			pos, lo, last = unpack('>ddd', v)
			if last + 1 > T then
				T = last + 1
			end
		end
		local at = now
		local j = pos - (n - cost + 1)
		if j >= 0 then
			at = max(now, slot(key, v, nil, 0, j % n) + ws[i] + 1)
			if at > T then
				T = at
			end
		end
		QAT[i] = at
		if last and last + 1 > at then
			-- The log's order: an admission another handler holds until
			-- later (its wait), or Redis TIME that stepped back.
			at = last + 1
		end
		V[i], POS[i], LO[i], LAST[i], AT[i] = v, pos, lo, last, at
	end
	local hold = T - now
	-- A hold of 1µs is the same-microsecond nudge, not a wait.
	local admit = hold <= max(maxwait, 1)
	if admit then
		out[o + 1], out[o + 2] = hold, T
	else
		out[o + 1], out[o + 2] = -max(1, hold - maxwait), 0
		-- Rejected by a quota, or only by a log's order (no ban then);
		-- ORDERED when a log holds an admission ahead of now (a request
		-- another handler holds until later: its slot may be given back
		-- at any moment, and the rejection then ends sooner), or its order
		-- makes the request wait longer than the quotas would.
		byQuota = false
		local qT, ahead = now, false
		for i = 1, r do
			if QAT[i] - now > maxwait then
				byQuota = true
			end
			qT = max(qT, QAT[i])
			if LAST[i] and LAST[i] > now then
				ahead = true
			end
		end
		if ahead or T > qT then
			out[o + 2] = ORDERED
		end
	end
	for i = 1, r do
		local key, n, w, v, pos = KEYS[k + i], ns[i], ws[i], V[i], POS[i]
		do
			-- Find the first slot at or after now - w: step on from the
			-- hint a few times, else binary search the rest of the ring.
			local thr = now - w
			local lo, hi = max(LO[i], pos - n), pos
			local first = nil
			local c, co = nil, 0
			if LAST[i] == nil or LAST[i] < thr then
				lo = hi
			else
				-- Slots lo.. (not wrapping) in one call, unless read already.
				local m = min(STEP, hi - lo, n - lo % n)
				if m > 1 and HDR + 8 * (lo % n) + 8 > #v then
					co = HDR + 8 * (lo % n)
					c = redis.call('GETRANGE', key, fmt('%d', co), fmt('%d', co + 8 * m - 1))
				end
				local steps = 0
				while lo < hi do
					local x = slot(key, v, c, co, lo % n)
					if x >= thr then
						first = x
						break
					end
					lo = lo + 1
					steps = steps + 1
					if steps == STEP then
						while lo < hi do
							local mid = math.floor((lo + hi) / 2)
							if slot(key, v, c, co, mid % n) >= thr then
								hi = mid
							else
								lo = mid + 1
							end
						end
						break
					end
				end
			end
			local inwin = pos - lo
			if inwin > 0 and not first then
				first = slot(key, v, c, co, lo % n)
			end
			if admit then
				-- cost slots from ring slot j on, wrapping to slot 0.
				local j = pos % n
				local m1 = min(cost, n - j)
				local rec = pack('>d', T)
				if m1 > 1 then
					rec = string.rep(rec, m1)
				end
				local hdr = pack('>ddd', pos + cost, lo, T)
				-- The log matters while its newest admission is in a window.
				local expMs = math.ceil((T + w + 1) / 1000)
				if expMs ~= lastExp then
					lastExp, lastExpS = expMs, fmt('%d', expMs)
				end
				local exp = lastExpS
				EXP[i] = expMs
				if #v < PRE then
					-- v is the whole log: the same bytes the SETRANGEs
					-- below would leave, in one SET.
					local value
					if HDR + 8 * j == #v and cost == m1 then
						value = hdr .. string.sub(v, HDR + 1) .. rec
					else
						local body = splice(string.sub(v, HDR + 1), 8 * j, rec)
						if cost > m1 then
							body = splice(body, 0, string.rep(pack('>d', T), cost - m1))
						end
						value = hdr .. body
					end
					wrote = true
					redis.call('SET', key, value, 'PXAT', exp)
				else
					wrote = true
					redis.call('SETRANGE', key, fmt('%d', HDR + 8 * j), rec)
					if cost > m1 then
						redis.call('SETRANGE', key, '24', string.rep(pack('>d', T), cost - m1))
					end
					redis.call('SETRANGE', key, '0', hdr)
					redis.call('PEXPIREAT', key, exp)
				end
				inwin = inwin + cost
				first = first or T
			end
			-- The quota left (also when this request costs more), and when
			-- it grows; for a rate that rejects the request, when the
			-- request would pass.
			out[o + 1 + 2 * i] = max(0, n - inwin)
			if not admit and AT[i] - now > maxwait then
				-- A rate that rejects: its quota as -(rem+1), so the
				-- caller reports a rejecting rate in the RateLimit field.
				out[o + 1 + 2 * i], out[o + 2 + 2 * i] = -max(0, n - inwin) - 1, AT[i] - now
			elseif first then
				out[o + 2 + 2 * i] = first + w + 1 - now
			else
				out[o + 2 + 2 * i] = 0
			end
		end
	end
end

-- redis_ratelimit, algorithm sliding_window: an exact sliding log, checked for
-- every rate of one limit before anything is written.
--
-- KEYS[i]  the log of rate i, a string of 8-byte big-endian doubles:
--          a 24-byte header {pos, lo, last}, then a ring of n slots.
--          pos  counts the slots ever written to the log; slot number j is
--               in ring slot j % n, so the ring holds the last n, the oldest
--               at ring slot pos % n. Times (µs, Redis TIME) never decrease;
--               one admission of cost c writes c slots with one time, and
--               two admissions never share a time.
--          lo   the first slot that was within the window at the last
--               write (a hint for counting the remaining quota).
--          last the time of the latest admission.
-- ARGV[1]  c, the cost of the request (1 <= c <= every rate's n).
-- ARGV[2]  the longest hold in µs (wait): a request that every rate admits
--          within it is recorded at that future moment and held until then.
-- ARGV[2i+1] n, ARGV[2i+2] window w in µs, of rate i.
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
-- steady state; 3 in all (TIME, GETRANGE, SET) for a short log.
--
-- Returns {admitted 1|0, µs to hold the request when admitted, else µs until
--          it would be admitted, T (0 when rejected),
--          then for each rate: remaining quota, µs until it grows (0 = full)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local HDR = 24
local PRE = 256 -- bytes read first: the header and slots 0..28
local STEP = 4 -- slots stepped through from the hint before a binary search
local cost = tonumber(ARGV[1])
local maxwait = tonumber(ARGV[2])

-- slot reads slot j of log s: from the bytes read already, else from Redis.
local function slot(s, j)
	local off = HDR + 8 * j
	if off + 8 <= #s.v then
		return (struct.unpack('>d', s.v, off + 1))
	end
	if s.c and off >= s.co and off + 8 <= s.co + #s.c then
		return (struct.unpack('>d', s.c, off - s.co + 1))
	end
	return (struct.unpack('>d', redis.call('GETRANGE', s.k, off, off + 7)))
end

-- fetch reads slots j..j+m-1 of log s (not wrapping) in one call, unless
-- slot j was read already.
local function fetch(s, j, m)
	local off = HDR + 8 * j
	if m > 1 and off + 8 > #s.v then
		s.co = off
		s.c = redis.call('GETRANGE', s.k, off, off + 8 * m - 1)
	end
end

-- splice puts x at byte off of b (padding b with zero bytes up to off).
local function splice(b, off, x)
	if #b < off then
		b = b .. string.rep('\0', off - #b)
	end
	return string.sub(b, 1, off) .. x .. string.sub(b, off + #x + 1)
end

-- The earliest moment T every rate admits the request: not before now,
-- after every log's latest admission (times stay unique), and after each
-- rate's (n-c+1)-th latest slot has left its window.
local st = {}
local T = now
for i = 1, #KEYS do
	local n = tonumber(ARGV[2 * i + 1])
	local w = tonumber(ARGV[2 * i + 2])
	local s = {k = KEYS[i], n = n, w = w, pos = 0, lo = 0, at = now}
	s.v = redis.call('GETRANGE', s.k, 0, PRE - 1)
	-- Shorter than PRE: s.v is the whole log (or no log).
	s.whole = #s.v < PRE
	if #s.v >= HDR then
		s.pos, s.lo, s.last = struct.unpack('>ddd', s.v)
		if s.last + 1 > T then
			T = s.last + 1
		end
	end
	local j = s.pos - (n - cost + 1)
	if j >= 0 then
		s.at = math.max(now, slot(s, j % n) + w + 1)
		if s.at > T then
			T = s.at
		end
	end
	st[i] = s
end
local hold = T - now
-- A hold of 1µs is the same-microsecond nudge, not a wait.
local admit = 0
if hold <= math.max(maxwait, 1) then
	admit = 1
end

local out = {admit, hold, 0}
if admit == 1 then
	out[3] = T
else
	out[2] = math.max(1, hold - maxwait)
end
for i = 1, #KEYS do
	local s = st[i]
	if admit == 0 and s.at - now > maxwait then
		out[2 * i + 2] = 0
		out[2 * i + 3] = s.at - now
	else
		-- Find the first slot at or after now - w: step on from the hint a
		-- few times, else binary search the rest of the ring.
		local thr = now - s.w
		local lo, hi = math.max(s.lo, s.pos - s.n), s.pos
		local first = nil
		if s.last == nil or s.last < thr then
			lo = hi
		else
			fetch(s, lo % s.n, math.min(STEP, hi - lo, s.n - lo % s.n))
			local steps = 0
			while lo < hi do
				local v = slot(s, lo % s.n)
				if v >= thr then
					first = v
					break
				end
				lo = lo + 1
				steps = steps + 1
				if steps == STEP then
					while lo < hi do
						local mid = math.floor((lo + hi) / 2)
						if slot(s, mid % s.n) >= thr then
							hi = mid
						else
							lo = mid + 1
						end
					end
					break
				end
			end
		end
		local inwin = s.pos - lo
		if inwin > 0 and not first then
			first = slot(s, lo % s.n)
		end
		if admit == 1 then
			-- cost slots from ring slot j on, wrapping to slot 0.
			local j = s.pos % s.n
			local m1 = math.min(cost, s.n - j)
			local rec = struct.pack('>d', T)
			local hdr = struct.pack('>ddd', s.pos + cost, lo, T)
			-- The log matters while its newest admission is in a window.
			local exp = math.ceil((T + s.w + 1) / 1000)
			if s.whole then
				-- The same bytes the SETRANGEs below would leave.
				local body = splice(string.sub(s.v, HDR + 1), 8 * j, string.rep(rec, m1))
				if cost > m1 then
					body = splice(body, 0, string.rep(rec, cost - m1))
				end
				redis.call('SET', s.k, hdr .. body, 'PXAT', exp)
			else
				redis.call('SETRANGE', s.k, HDR + 8 * j, string.rep(rec, m1))
				if cost > m1 then
					redis.call('SETRANGE', s.k, HDR, string.rep(rec, cost - m1))
				end
				redis.call('SETRANGE', s.k, 0, hdr)
				redis.call('PEXPIREAT', s.k, exp)
			end
			inwin = inwin + cost
			first = first or T
		end
		out[2 * i + 2] = math.max(0, s.n - inwin)
		if first then
			out[2 * i + 3] = first + s.w + 1 - now
		else
			out[2 * i + 3] = 0
		end
	end
end
return out

-- redis_ratelimit, algorithm sliding_window: an exact sliding log, checked for
-- every rate of one limit before anything is written.
--
-- KEYS[i]  the log of rate i, a string of 8-byte big-endian doubles:
--          a 24-byte header {pos, lo, last}, then a ring of n slots.
--          pos  counts the admissions ever written to the log; admission j is
--               in slot j % n, so the ring holds the last n, the oldest at
--               slot pos % n. Times (µs, Redis TIME) strictly increase.
--          lo   the first admission that was within the window at the last
--               write (a hint for counting the remaining quota).
--          last the time of the latest admission.
-- ARGV[2i-1] n, ARGV[2i] window w in µs, of rate i.
--
-- Rate i admits a request at time t when the n-th latest admission is older
-- than t - w. Then no closed interval of length w ever holds n+1 admissions.
-- The request is recorded (in every log) only when every rate admits it.
--
-- The log is read with GETRANGE: its first PRE bytes (the header and the
-- first slots) in one call, other slots 8 bytes at a time, or a few at once
-- where the search steps through them (copying the whole log into Lua costs
-- more, already at a few hundred slots). A log shorter than PRE bytes is
-- then known whole and written back with one SET (value and expiry); a
-- longer one with two SETRANGEs and a PEXPIREAT. O(1) calls per request in
-- the steady state; 3 in all (TIME, GETRANGE, SET) for a short log.
--
-- Returns {admitted 1|0, µs until every rate admits it (0 when admitted),
--          then for each rate: remaining quota, µs until it grows (0 = full)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local HDR = 24
local PRE = 256 -- bytes read first: the header and slots 0..28
local STEP = 4 -- slots stepped through from the hint before a binary search

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

local st = {}
local admit = 1
local wait = 0
for i = 1, #KEYS do
	local n = tonumber(ARGV[2 * i - 1])
	local w = tonumber(ARGV[2 * i])
	local s = {k = KEYS[i], n = n, w = w, pos = 0, lo = 0, rec = now}
	s.v = redis.call('GETRANGE', s.k, 0, PRE - 1)
	-- Shorter than PRE: s.v is the whole log (or no log).
	s.whole = #s.v < PRE
	if #s.v >= HDR then
		s.pos, s.lo, s.last = struct.unpack('>ddd', s.v)
		-- Same microsecond (or a clock step back): keep times unique and
		-- increasing by recording a little later, which only makes it stricter.
		if s.last >= now then
			s.rec = s.last + 1
		end
	end
	if s.pos >= n then
		local oldest = slot(s, s.pos % n)
		if oldest >= s.rec - w then
			s.wait = oldest + w + 1 - now
			admit = 0
			if s.wait > wait then
				wait = s.wait
			end
		end
	end
	st[i] = s
end

local out = {admit, wait}
for i = 1, #KEYS do
	local s = st[i]
	if s.wait then
		out[2 * i + 1] = 0
		out[2 * i + 2] = s.wait
	else
		-- Find the first admission at or after now - w: step on from the
		-- hint a few times, else binary search the rest of the ring.
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
			local j = s.pos % s.n
			local off = HDR + 8 * j
			local hdr = struct.pack('>ddd', s.pos + 1, lo, s.rec)
			-- The log matters while its newest admission is in a window.
			local exp = math.ceil((s.rec + s.w + 1) / 1000)
			if s.whole then
				-- The same bytes the SETRANGEs below would leave.
				local body = string.sub(s.v, HDR + 1, off)
				if #body < off - HDR then
					body = body .. string.rep('\0', off - HDR - #body)
				end
				redis.call('SET', s.k, hdr .. body .. struct.pack('>d', s.rec) .. string.sub(s.v, off + 9), 'PXAT', exp)
			else
				redis.call('SETRANGE', s.k, off, struct.pack('>d', s.rec))
				redis.call('SETRANGE', s.k, 0, hdr)
				redis.call('PEXPIREAT', s.k, exp)
			end
			inwin = inwin + 1
			first = first or s.rec
		end
		out[2 * i + 1] = math.max(0, s.n - inwin)
		if first then
			out[2 * i + 2] = first + s.w + 1 - now
		else
			out[2 * i + 2] = 0
		end
	end
end
return out

-- redis_ratelimit, algorithm sliding_window: an exact sliding log, checked for
-- every rate of one limit before anything is written.
--
-- KEYS[i]  the log of rate i, a string of 8-byte big-endian doubles:
--          bytes 0-7 count the admissions ever written to it (pos); slot j at
--          byte 8+8j holds the time (µs, Redis TIME) of admission j, j+n,
--          j+2n, ...: a ring of the last n admissions, the oldest at pos % n.
--          Times in one log strictly increase.
-- ARGV[2i-1] n, ARGV[2i] window w in µs, of rate i.
--
-- Rate i admits a request at time t when the n-th latest admission is older
-- than t - w. Then no closed interval of length w ever holds n+1 admissions.
-- The request is recorded (in every log) only when every rate admits it.
--
-- Returns {admitted 1|0, µs until every rate admits it (0 when admitted),
--          then for each rate: remaining quota, µs until it grows (0 = full)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function slot(k, j)
	return (struct.unpack('>d', redis.call('GETRANGE', k, 8 + 8 * j, 15 + 8 * j)))
end

local st = {}
local admit = 1
local wait = 0
for i = 1, #KEYS do
	local k = KEYS[i]
	local n = tonumber(ARGV[2 * i - 1])
	local w = tonumber(ARGV[2 * i])
	local s = {k = k, n = n, w = w, pos = 0, rec = now}
	local h = redis.call('GETRANGE', k, 0, 7)
	if #h == 8 then
		s.pos = (struct.unpack('>d', h))
	end
	if s.pos > 0 then
		s.last = slot(k, (s.pos - 1) % n)
		-- Same microsecond (or a clock step back): keep times unique and
		-- increasing by recording a little later, which only makes it stricter.
		if s.last >= now then
			s.rec = s.last + 1
		end
	end
	if s.pos >= n then
		local oldest = slot(k, s.pos % n)
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
		-- Count the admissions at or after now - w: binary search the ring
		-- for the first of them.
		local thr = now - s.w
		local lo, hi = math.max(0, s.pos - s.n), s.pos
		if s.last == nil or s.last < thr then
			lo = hi
		end
		while lo < hi do
			local mid = math.floor((lo + hi) / 2)
			if slot(s.k, mid % s.n) >= thr then
				hi = mid
			else
				lo = mid + 1
			end
		end
		local inwin = s.pos - lo
		local first = nil
		if inwin > 0 then
			first = slot(s.k, lo % s.n)
		end
		if admit == 1 then
			inwin = inwin + 1
			first = first or s.rec
			redis.call('SETRANGE', s.k, 8 + 8 * (s.pos % s.n), struct.pack('>d', s.rec))
			redis.call('SETRANGE', s.k, 0, struct.pack('>d', s.pos + 1))
			-- The log matters while its newest admission is in a window.
			redis.call('PEXPIREAT', s.k, math.ceil((s.rec + s.w + 1) / 1000))
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

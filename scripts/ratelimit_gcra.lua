-- redis_ratelimit, algorithm gcra: the generic cell rate algorithm, checked
-- for every rate of one limit before anything is written.
--
-- KEYS[i]  the theoretical arrival time (TAT, µs, Redis TIME) of rate i.
-- ARGV[3i-2] n, ARGV[3i-1] window w in µs, ARGV[3i] burst, of rate i.
--
-- One request costs T = w/n; a request is admitted when TAT + T - burst*T is
-- not after now. So at most burst + t*n/w requests pass in any interval t.
-- The request is recorded (in every TAT) only when every rate admits it.
--
-- Returns {admitted 1|0, µs until every rate admits it (0 when admitted),
--          then for each rate: remaining quota, µs until it grows (0 = full)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local st = {}
local admit = 1
local wait = 0
for i = 1, #KEYS do
	local n = tonumber(ARGV[3 * i - 2])
	local w = tonumber(ARGV[3 * i - 1])
	local burst = tonumber(ARGV[3 * i])
	local s = {k = KEYS[i], T = w / n, burst = burst, tat = now}
	s.tau = burst * s.T
	local v = redis.call('GET', s.k)
	if v then
		s.tat = math.max(tonumber(v), now)
	end
	local allow_at = s.tat + s.T - s.tau
	if allow_at > now then
		s.wait = math.ceil(allow_at - now)
		admit = 0
		if s.wait > wait then
			wait = s.wait
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
		local tat = s.tat
		if admit == 1 then
			tat = tat + s.T
			-- The state matters until the TAT is in the past.
			redis.call('SET', s.k, string.format('%.17g', tat), 'PXAT', math.ceil(tat / 1000))
		end
		local debt = tat - now
		-- Half a microsecond of slack absorbs the rounding of µs-sized doubles.
		local rem = math.floor((s.tau - debt + 0.5) / s.T)
		if rem < 0 then
			rem = 0
		end
		out[2 * i + 1] = rem
		if rem >= s.burst then
			out[2 * i + 2] = 0
		else
			out[2 * i + 2] = math.max(1, math.ceil(debt - s.tau + (rem + 1) * s.T))
		end
	end
end
return out

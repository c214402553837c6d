-- redis_ratelimit, algorithm gcra: the generic cell rate algorithm, checked
-- for every rate of one limit before anything is written.
--
-- KEYS[i]  the theoretical arrival time (TAT, µs, Redis TIME) of rate i.
-- ARGV[1]  c, the cost of the request (1 <= c <= every rate's burst).
-- ARGV[2]  the longest hold in µs (wait): a request that every rate admits
--          within it is recorded as arriving at that future moment A and
--          held until then.
-- ARGV[3i] n, ARGV[3i+1] window w in µs, ARGV[3i+2] burst, of rate i.
--
-- One unit costs T = w/n; a request of cost c is admitted at A when
-- TAT + c*T - burst*T is not after A. So at most burst + t*n/w units pass in
-- any interval t. The request is recorded (in every TAT) only when every
-- rate admits it within the hold.
--
-- Returns {admitted 1|0, µs to hold the request when admitted, else µs until
--          it would be admitted, A (0 when rejected),
--          then for each rate: remaining quota, µs until it grows (0 = full)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local maxwait = tonumber(ARGV[2])

local st = {}
local A = now
for i = 1, #KEYS do
	local n = tonumber(ARGV[3 * i])
	local w = tonumber(ARGV[3 * i + 1])
	local burst = tonumber(ARGV[3 * i + 2])
	local s = {k = KEYS[i], T = w / n, burst = burst, tat = now}
	s.tau = burst * s.T
	local v = redis.call('GET', s.k)
	if v then
		s.tat = math.max(tonumber(v), now)
	end
	s.at = s.tat + cost * s.T - s.tau
	if s.at > A then
		A = s.at
	end
	st[i] = s
end
local hold = math.ceil(A - now)
local admit = 0
if hold <= maxwait then
	admit = 1
end

local out = {admit, hold, 0}
if admit == 1 then
	out[3] = math.ceil(A)
else
	out[2] = math.max(1, hold - maxwait)
end
for i = 1, #KEYS do
	local s = st[i]
	if admit == 0 and s.at - now > maxwait then
		out[2 * i + 2] = 0
		out[2 * i + 3] = math.ceil(s.at - now)
	else
		local tat = s.tat
		if admit == 1 then
			tat = math.max(tat, A) + cost * s.T
			-- The state matters until the TAT is in the past.
			redis.call('SET', s.k, string.format('%.17g', tat), 'PXAT', math.ceil(tat / 1000))
		end
		local debt = tat - now
		-- Half a microsecond of slack absorbs the rounding of µs-sized doubles.
		local rem = math.floor((s.tau - debt + 0.5) / s.T)
		if rem < 0 then
			rem = 0
		end
		out[2 * i + 2] = rem
		if rem >= s.burst then
			out[2 * i + 3] = 0
		else
			out[2 * i + 3] = math.max(1, math.ceil(debt - s.tau + (rem + 1) * s.T))
		end
	end
end
return out

-- redis_ratelimit, algorithm gcra: charge a rate's theoretical arrival time
-- with the admissions an instance made on its own while Redis was
-- unreachable (fail_local), whatever the TAT is: they were admitted already.
-- Its arithmetic (gcra_after) is ratelimit_gcra_step.lua, in front of it.
--
-- KEYS[1]  the TAT of the rate (format in ratelimit_gcra.lua).
-- KEYS[2]  the charge marker of the instance's local limiter on this key:
--          the highest sequence number of its charges applied here.
-- ARGV[1]  n; ARGV[2] the window w in µs; ARGV[3] burst; ARGV[4] how long
--          the marker lives (ms); then triples: the time of an admission
--          (µs, Redis TIME as the instance estimates it), ascending, its
--          cost, and its charge's sequence number (ascending).
--
-- A charge whose sequence number the marker already holds ran before (its
-- answer was lost, and the instance sent it again): it is skipped, so a
-- charge counts once however often it is sent.
--
-- The admissions are scheduled on their own (each cost * w/n from no
-- earlier than its time), and what is left of that schedule at now is added
-- to the TAT: the debt they would still hold had Redis seen them. The TAT
-- is then capped at now + burst * w/n (the key fully used: stricter would
-- lock the key out longer than any admission in Redis could). The returns kept on the key (its "TAT S X ..." form) stay.
-- Returns the TAT written (µs), or 0 when nothing was to charge.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, w, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local u = w / n
local fmt = string.format
local v = redis.call('GET', KEYS[1])
local tat, sum, x, list = now, nil, 0, ''
if v then
	tat = tonumber(v)
	if not tat then
		local ts, ss, xs, rest = string.match(v, '^(%S+) (%d+) (%d+)(.*)$')
		tat, sum, x, list = tonumber(ts), tonumber(ss), tonumber(xs), rest
	end
	if tat < now then
		-- Drained, as the decision script sees it.
		tat, list = now, ''
	end
end
local before = tat
local done = tonumber(redis.call('GET', KEYS[2]) or '0')
local top = done
local own = 0
for a = 5, #ARGV - 2, 3 do
	local at, c, seq = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
	if seq > done then
		own = gcra_after(own, at, c, u)
		if seq > top then
			top = seq
		end
	end
end
if top > done then
	redis.call('SET', KEYS[2], fmt('%d', top), 'PX', ARGV[4])
end
if own > now then
	tat = math.min(tat + own - now, math.max(before, now + burst * u))
end
if tat <= before then
	return 0
end
tat = math.ceil(tat)
local pxat = math.ceil(tat / 1000)
local value = fmt('%d', tat)
if sum then
	if x > pxat then
		pxat = x
	end
	value = fmt('%d %d %d%s', tat, sum, pxat, list)
end
redis.call('SET', KEYS[1], value, 'PXAT', fmt('%d', pxat))
return tat

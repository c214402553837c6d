#!lua flags=no-writes
-- Inspect: read one lock key's state, without changing anything.
-- KEYS[1] lock sorted set (member = holder token, score = lease end, ms of Redis TIME)
-- KEYS[2] fencing counter, KEYS[3] waitq (waiting instances, score = entry expiry ms)
-- KEYS[4] stored replay (<lockkey>:replay)
-- ARGV[1] this instance's id in the wait list, ARGV[2] how many bytes of a
-- stored answer to return
-- Returns {{lease left ms of each live holder}, fencing counter or "",
--          live waiting instances, 1 if ARGV[1] is one of them else 0,
--          replay type ("none" when absent), replay expiry ms (PTTL),
--          the replay's first ARGV[2] bytes (a string) or "", its size in bytes,
--          run: 0 no run record, 1 a run record whose holder's lease is
--          live, 2 one with no live lease (in doubt)}.
-- Holder tokens are never returned: a token can release the lock (a run
-- record's head is returned as "run1" alone).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = {}
local holders = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
for i = 2, #holders, 2 do
	left[#left + 1] = tonumber(holders[i]) - now
end
local fence = redis.call('GET', KEYS[2]) or ''
local waiting = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
local me = 0
local score = redis.call('ZSCORE', KEYS[3], ARGV[1])
if score and tonumber(score) > now then
	me = 1
end
local rtype = redis.call('TYPE', KEYS[4]).ok
local rttl, rhead, rsize = 0, '', 0
if rtype ~= 'none' then
	rttl = redis.call('PTTL', KEYS[4])
	if rtype == 'string' then
		-- The stored answer's format line and JSON head (status, headers)
		-- come first; the body can be large, so only the start is read.
		rsize = redis.call('STRLEN', KEYS[4])
		rhead = redis.call('GETRANGE', KEYS[4], 0, tonumber(ARGV[2]) - 1)
	end
end
local run = 0
if string.sub(rhead, 1, 5) == 'run1\n' then
	local record = redis.call('GET', KEYS[4])
	local nl = string.find(record, '\n', 6, true)
	local leaseEnd = redis.call('ZSCORE', KEYS[1], string.sub(record, 6, nl - 1))
	run = 2
	if leaseEnd and tonumber(leaseEnd) > now then
		run = 1
	end
	rhead = 'run1'
end
return {left, fence, waiting, me, rtype, rttl, rhead, rsize, run}

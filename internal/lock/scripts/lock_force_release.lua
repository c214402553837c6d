-- ForceRelease: remove every holder of a lock key and wake its waiters.
-- KEYS[1] lock sorted set, KEYS[2] its lock_delay ends (see lock_acquire.lua)
-- ARGV[1] wake channel, ARGV[2] wake message, ARGV[3] the locker's
-- lock_delay in ms (0 = none): each holder removed keeps its permit from
-- everyone for that long from now (a lease ended without its release);
-- with 0 the key is free at once.
-- The fencing counter stays: an old holder's extension then finds its lease
-- gone and does not re-create it (see lock_extend.lua), so on_lost applies.
-- Returns the number of live holders removed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local holders = redis.call('ZRANGE', KEYS[1], 0, -1)
local n = #holders
if n == 0 then
	return 0
end
local delay = tonumber(ARGV[3])
for _, h in ipairs(holders) do
	if delay > 0 then
		redis.call('ZADD', KEYS[2], now + delay, h)
	else
		redis.call('ZREM', KEYS[2], h)
	end
end
if delay > 0 then
	local dl = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[2], tonumber(dl[2]))
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return n

-- Admin API: force-release every holder of a lock key and wake its waiters.
-- KEYS[1] lock sorted set
-- ARGV[1] wake channel, ARGV[2] wake message
-- The fencing counter stays: an old holder's extension then finds its lease
-- gone and does not re-create it (see lock_extend.lua), so on_lost applies.
-- Returns the number of live holders removed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n == 0 then
	return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return n

#!lua flags=allow-oom
-- Extend a lease, owner-checked.
-- KEYS[1] lock sorted set; ARGV[1] token, ARGV[2] ttl ms, ARGV[3] permits,
-- ARGV[4] "1" to re-create a lease that is missing while a permit is free
-- (a Redlock server that restarted empty).
-- Returns 1 when the lease now runs ttl from now, 0 when it is lost.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or
	(ARGV[4] == '1' and redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3])) then
	redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
	local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
	return 1
end
return 0

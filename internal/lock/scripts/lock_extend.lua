#!lua flags=allow-oom
-- Extend a lease, owner-checked.
-- KEYS[1] lock sorted set, KEYS[2] fencing counter, KEYS[3] dead tokens (see
-- lock_acquire.lua): a token marked dead was released while this extension
-- was on its way, and is neither extended nor re-created
-- ARGV[1] token, ARGV[2] ttl ms, ARGV[3] permits,
-- ARGV[4] "1" to re-create a lease that is missing on a server that lost its
-- state (a Redlock server restarted empty: neither the lease nor the key's
-- fencing counter is there, and a permit is free). A server whose counter
-- is still there saw the lease end or be released, and never revives it.
-- KEYS[4] lock_delay ends (see lock_acquire.lua), ARGV[5] lock_delay ms (0 =
-- none): the lease's entry moves to its new end + the delay.
-- Returns 1 when the lease now runs ttl from now, 0 when it is lost.
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then
	return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or
	(ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3])) then
	redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
	local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
	local endms = tonumber(last[2])
	redis.call('PEXPIREAT', KEYS[1], endms)
	-- Keep the counter as long as the lease (re-create it at the time floor).
	-- Its value stays: it is the grant's TIME, which a busy acquire reports
	-- as the holder's start (lock_acquire.lua).
	local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
	local f = tonumber(redis.call('GET', KEYS[2]) or '') or us
	redis.call('SET', KEYS[2], string.format('%d', f), 'PXAT', endms + ttl)
	local delay = tonumber(ARGV[5])
	if delay > 0 then
		redis.call('ZADD', KEYS[4], now + ttl + delay, ARGV[1])
		local dl = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')
		redis.call('PEXPIREAT', KEYS[4], tonumber(dl[2]))
	end
	return 1
end
return 0

#!lua
-- Renew a held lease for another block of local hand-offs, unless another
-- Caddy instance is waiting for the key (then it must get its turn).
-- KEYS[1] lock sorted set, KEYS[2] fencing counter, KEYS[3] waitq
-- ARGV[1] token, ARGV[2] ttl ms, ARGV[3] instance id, ARGV[4] tokens to reserve
-- KEYS[4] lock_delay ends, ARGV[5] lock_delay ms (see lock_extend.lua)
-- Returns {1, fence} (the new block's last token), or {0, 0} when the lease
-- is not held any more or another instance waits.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
	return {0, 0}
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local waiting = redis.call('ZRANGE', KEYS[3], 0, -1)
for _, id in ipairs(waiting) do
	if id ~= ARGV[3] then
		return {0, 0}
	end
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
local k = tonumber(ARGV[4])
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local f = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + k, us + k - 1)
redis.call('SET', KEYS[2], string.format('%d', f), 'PXAT', tonumber(last[2]) + ttl)
local delay = tonumber(ARGV[5])
if delay > 0 then
	redis.call('ZADD', KEYS[4], now + ttl + delay, ARGV[1])
	local dl = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[4], tonumber(dl[2]))
end
return {1, f}

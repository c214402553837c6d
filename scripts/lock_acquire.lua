-- Take one permit of a lock, owner-checked, with a fencing counter.
-- KEYS[1] lock: sorted set, member = holder token, score = lease end (ms, Redis TIME)
-- KEYS[2] fence: integer counter, one per lock key, never expires
-- KEYS[3] waitq: sorted set of waiting Caddy instances, score = entry expiry (ms)
-- ARGV[1] token, ARGV[2] ttl ms, ARGV[3] permits, ARGV[4] instance id,
-- ARGV[5] waitq entry lifetime ms
-- Returns {1, fence} when taken; {0, ms until the earliest lease ends} when not.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local permits = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
local free = redis.call('ZCARD', KEYS[1]) < permits
if free and not held then
	-- Instances take turns: when another instance has waited longer, it goes first.
	local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
	if head and head ~= ARGV[4] then
		redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[4])
		redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[5]))
		return {0, 0}
	end
end
if free or held then
	redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
	local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
	redis.call('ZREM', KEYS[3], ARGV[4])
	return {1, redis.call('INCR', KEYS[2])}
end
-- Busy: queue this instance and say when the earliest lease ends. An entry
-- lives as long as its instance keeps asking; the instance that asked least
-- recently stands first, so instances take turns.
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[4])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[5]))
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, tonumber(first[2]) - now}

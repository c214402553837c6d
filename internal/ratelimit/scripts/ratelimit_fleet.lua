-- redis_ratelimit: the instances sharing one prefix (see fleet.go).
-- KEYS[1] the heartbeats: a sorted set of instance ids, scored by the Redis
--         TIME (µs) of their latest heartbeat
-- ARGV[1] this instance's id
-- ARGV[2] how long a heartbeat lives, µs
-- ARGV[3] the Redis TIME (µs) of this instance's first heartbeat that the
--         others may not have counted yet, or 0: this heartbeat's time
-- Returns {Redis TIME in µs, the instances with a live heartbeat, 1 when
-- this heartbeat added the instance to the set (else 0), the other
-- instances whose latest heartbeat is not after ARGV[3]: those that have
-- not read a count with this instance in it since}. The set expires once
-- no heartbeat is recorded in it for a heartbeat's life.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fmt = string.format
local life = tonumber(ARGV[2])
local since = tonumber(ARGV[3])
if since <= 0 or since > now then
	since = now
end
local added = redis.call('ZADD', KEYS[1], fmt('%d', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', fmt('(%d', now - life))
redis.call('PEXPIRE', KEYS[1], fmt('%d', math.ceil(life / 1000)))
local behind = redis.call('ZCOUNT', KEYS[1], '-inf', fmt('%d', since))
if since == now then
	behind = behind - 1 -- this instance's own heartbeat
end
return {now, redis.call('ZCARD', KEYS[1]), added, behind}

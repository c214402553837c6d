-- redis_ratelimit: the instances sharing one prefix (see ratelimit_fleet.go).
-- KEYS[1] the heartbeats: a sorted set of instance ids, scored by the Redis
--         TIME (µs) of their latest heartbeat
-- ARGV[1] this instance's id
-- ARGV[2] how long a heartbeat lives, µs
-- Returns {Redis TIME in µs, the instances with a live heartbeat}. The set
-- expires once no heartbeat is recorded in it for a heartbeat's life.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fmt = string.format
local life = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], fmt('%d', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', fmt('(%d', now - life))
redis.call('PEXPIRE', KEYS[1], fmt('%d', math.ceil(life / 1000)))
return {now, redis.call('ZCARD', KEYS[1])}

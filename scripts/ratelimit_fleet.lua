-- redis_ratelimit: the instances sharing one prefix (see ratelimit_fleet.go).
-- KEYS[1] the heartbeats: a sorted set of instance ids, scored by the Redis
--         TIME (µs) of their latest heartbeat
-- KEYS[2] the resets: a sorted set of limit ids the admin API reset, scored
--         by the Redis TIME (µs) of the reset
-- ARGV[1] this instance's id, to record a heartbeat ("" for none)
-- ARGV[2] how long a heartbeat lives, µs
-- ARGV[3] a limit id to record as reset ("" for none)
-- ARGV[4] how long a reset is kept, µs
-- Returns {Redis TIME in µs, the instances with a live heartbeat (-1 when
-- no heartbeat was recorded)}. Both sets expire once nothing is recorded in
-- them for their lifetime. (The instances read the resets with
-- ZRANGEBYSCORE.)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fmt = string.format
local out = {now, -1}
if ARGV[1] ~= '' then
	local life = tonumber(ARGV[2])
	redis.call('ZADD', KEYS[1], fmt('%d', now), ARGV[1])
	redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', fmt('(%d', now - life))
	redis.call('PEXPIRE', KEYS[1], fmt('%d', math.ceil(life / 1000)))
	out[2] = redis.call('ZCARD', KEYS[1])
end
if ARGV[3] ~= '' then
	local kept = tonumber(ARGV[4])
	redis.call('ZADD', KEYS[2], fmt('%d', now), ARGV[3])
	redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt('(%d', now - kept))
	redis.call('PEXPIRE', KEYS[2], fmt('%d', math.ceil(kept / 1000)))
end
return out

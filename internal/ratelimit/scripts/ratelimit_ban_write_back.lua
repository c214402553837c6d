-- redis_ratelimit: write back a ban to a Redis that lacks it (a new process
-- after a restart), as the decision script would have set it.
-- KEYS[1] the ban's key
-- ARGV[1] ms until the ban ends: the key expires then
-- ARGV[2] µs from now until a request may pass: the key holds that moment
--         (Redis TIME)
-- Returns 1 when it set the key, 0 when the key was there (left as it is).
local t = redis.call('TIME')
local at = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[2])
return redis.call('SET', KEYS[1], string.format('%d', at), 'PX', ARGV[1], 'NX') and 1 or 0

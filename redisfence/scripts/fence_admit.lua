#!lua
-- redis_fence: admit a write only with a fencing token at least the highest
-- admitted so far for the key, atomically, and record it.
-- KEYS[1] the highest token admitted for the key (a string of digits)
-- ARGV[1] the write's token (digits), ARGV[2] retain ms: the record lives
-- this long after its last admitted write, ARGV[3] how far ahead of Redis
-- TIME (µs) a token may be (a token from further in the future is refused:
-- admitted, it would fence out every real holder for the retain time),
-- ARGV[4] when this Redis process started (Redis TIME µs, never before the
-- real start), or 0 while unknown
-- Tokens carry a Redis-TIME floor in µs (see lock_acquire.lua), so a token
-- older than TIME - retain is stale even without a record, and so is a
-- token older than the process: the records it was checked against may be
-- lost (a restart without persistence).
-- Returns 1 admitted, 0 stale, -1 from the future, -2 older than the process.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tok = tonumber(ARGV[1])
local retain = tonumber(ARGV[2])
if tok > now + tonumber(ARGV[3]) then
	return -1
end
if tok < now - retain * 1000 then
	return 0
end
if tok < tonumber(ARGV[4]) then
	return -2
end
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tok < cur then
	return 0
end
if tok > cur then
	redis.call('SET', KEYS[1], ARGV[1], 'PX', retain)
else
	redis.call('PEXPIRE', KEYS[1], retain)
end
return 1

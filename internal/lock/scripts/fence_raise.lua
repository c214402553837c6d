#!lua
-- Raise a fencing counter to at least ARGV[1] (several keys: every key's
-- counter must reach the one token that serves them all). Returns the counter.
-- ARGV[2] ms the counter lives on (it expires once its lock is idle).
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if c < want then
	redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
	return want
end
return c

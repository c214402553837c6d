#!lua
-- Raise a fencing counter to at least ARGV[1] (Redlock: write the quorum's
-- highest token back, so any later majority sees it). Returns the counter.
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if c < want then
	redis.call('SET', KEYS[1], ARGV[1])
	return want
end
return c

#!lua
-- Store a holder's answer for replay when its lease is no longer known to
-- be live by its own clock: only when the token still holds the lock, or
-- the replay key holds this token's own run record (see lock_acquire.lua:
-- then nobody else ran since). Never over another token's run record or
-- answer. The lease is released afterwards, as any.
-- KEYS[1] lock sorted set, KEYS[2] replay key
-- ARGV[1] token, ARGV[2] answer, ARGV[3] ms to keep it
-- Returns 1 when stored, 0 otherwise.
local cur = redis.call('GET', KEYS[2])
local own = 'run1\n' .. ARGV[1] .. '\n'
if cur and string.sub(cur, 1, #own) == own then
	redis.call('SET', KEYS[2], ARGV[2], 'PX', tonumber(ARGV[3]))
	return 1
end
if cur then
	return 0
end
local leaseEnd = redis.call('ZSCORE', KEYS[1], ARGV[1])
local t = redis.call('TIME')
if leaseEnd and tonumber(leaseEnd) > tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
	redis.call('SET', KEYS[2], ARGV[2], 'PX', tonumber(ARGV[3]))
	return 1
end
return 0

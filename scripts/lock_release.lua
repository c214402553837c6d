#!lua flags=allow-oom
-- Release a lease, owner-checked, and wake the waiters of other instances.
-- KEYS[1] lock sorted set; KEYS[2] fencing counter
-- ARGV[1] token, ARGV[2] wake channel, ARGV[3] message ("" = no wake-up:
-- the undo of a failed attempt must not make its rivals retry in step),
-- ARGV[4] fencing token to write back (Redlock: the highest counter the
-- granting majority returned, so the next majority sees it; 0 = none)
-- Returns 1 when this token held the lock, 0 otherwise.
local raise = tonumber(ARGV[4])
if raise > 0 then
	local c = tonumber(redis.call('GET', KEYS[2]) or '0')
	if c < raise then
		redis.call('SET', KEYS[2], ARGV[4])
	end
end
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if removed == 1 and ARGV[3] ~= '' then
	redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return removed

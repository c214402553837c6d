-- Release a lease, owner-checked, and wake the waiters of other instances.
-- KEYS[1] lock sorted set; ARGV[1] token, ARGV[2] wake channel, ARGV[3] message
-- Returns 1 when this token held the lock, 0 otherwise.
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if removed == 1 then
	redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return removed

#!lua flags=allow-oom
-- Release a lease, owner-checked, and wake the waiters of other instances.
-- KEYS[1] lock sorted set; KEYS[2] fencing counter
-- ARGV[1] token, ARGV[2] wake channel, ARGV[3] message ("" = no wake-up:
-- the undo of a failed attempt must not make its rivals retry in step),
-- ARGV[4] fencing token to write back (Redlock: the highest counter the
-- granting majority returned, so the next majority sees it; 0 = none),
-- ARGV[5] ttl ms (a counter written back lives on for twice that)
-- ARGV[6] the holder's answer to store for replay ("" = none), ARGV[7] how
-- long it is kept (ms); KEYS[3] where. It is stored only while the token
-- still holds the lock, in the same script that releases it, so a waiter
-- can never take the lock and miss it.
-- KEYS[4] the key's wait list, ARGV[8] the releasing instance's id: the
-- wake-up is published only when another instance waits (an uncontended
-- release sends no message; waiters of this instance are woken locally).
-- KEYS[5] the key's dead tokens, ARGV[9] how long (ms) to keep this token
-- there ("0" = not at all): the undo of an attempt whose outcome is not
-- known, so that the attempt, should it reach Redis only now, takes nothing
-- (see lock_acquire.lua).
-- KEYS[6] lock_delay ends (see lock_acquire.lua), ARGV[10] "1" when the
-- holder did not finish cleanly (its client went away while the route ran, or
-- it lost the lease), ARGV[11] lock_delay ms: an unclean release of a live
-- lease keeps the key from everyone for the delay from now; a clean one (also
-- the undo of an outcome nobody knew) removes the token's entry. A lease that
-- ended without its release (expired, force-released) keeps its entry.
-- ARGV[12] "1": a run record of this token (see lock_acquire.lua) in KEYS[3]
-- is deleted (the run did not happen, or failed: another may run); "0": it
-- stays (the run's outcome is in doubt), unless an answer is stored over it.
-- An answer is stored while the token holds the lock, or when KEYS[3] holds
-- this token's own run record (nobody else can have run since: the record
-- refused them); never over another token's run record.
-- Returns 1 when this token held the lock, 0 otherwise.
local dead = tonumber(ARGV[9])
-- The uncontended path: nothing to mark dead, write back or store, no
-- lock_delay to start, and no delay entry or wait list on the key (one
-- EXISTS for both): the release is the owner-checked ZREM alone (nobody
-- waits elsewhere, so there is no wake-up to send).
if dead == 0 and ARGV[4] == '0' and ARGV[6] == '' and (ARGV[10] ~= '1' or ARGV[11] == '0') and ARGV[12] ~= '1'
	and redis.call('EXISTS', KEYS[4], KEYS[6]) == 0 then
	return redis.call('ZREM', KEYS[1], ARGV[1])
end
if dead > 0 then
	local t = redis.call('TIME')
	local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
	redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
	redis.call('ZADD', KEYS[5], now + dead, ARGV[1])
	-- The set lives as long as its longest-lived token (handlers with
	-- other ttls may share the key).
	local last = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[5], tonumber(last[2]))
end
local raise = tonumber(ARGV[4])
if raise > 0 then
	local c = tonumber(redis.call('GET', KEYS[2]) or '0')
	if c < raise then
		if redis.call('PTTL', KEYS[2]) > 0 then
			redis.call('SET', KEYS[2], ARGV[4], 'KEEPTTL')
		else
			redis.call('SET', KEYS[2], ARGV[4], 'PX', 2 * tonumber(ARGV[5]))
		end
	end
end
if ARGV[6] ~= '' or ARGV[12] == '1' then
	local cur = redis.call('GET', KEYS[3])
	local own = 'run1\n' .. ARGV[1] .. '\n'
	local ownRun = cur and string.sub(cur, 1, #own) == own
	local otherRun = cur and not ownRun and string.sub(cur, 1, 5) == 'run1\n'
	local leaseEnd = redis.call('ZSCORE', KEYS[1], ARGV[1])
	local t = redis.call('TIME')
	local live = leaseEnd and tonumber(leaseEnd) > tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
	if ARGV[6] ~= '' and not otherRun and (live or ownRun) then
		redis.call('SET', KEYS[3], ARGV[6], 'PX', tonumber(ARGV[7]))
	elseif ARGV[12] == '1' and ownRun then
		redis.call('DEL', KEYS[3])
	end
end
local leaseEnd = redis.call('ZSCORE', KEYS[1], ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = leaseEnd and tonumber(leaseEnd) > now
local delay = tonumber(ARGV[11])
if live and ARGV[10] == '1' and delay > 0 then
	redis.call('ZADD', KEYS[6], now + delay, ARGV[1])
	local dl = redis.call('ZRANGE', KEYS[6], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[6], tonumber(dl[2]))
elseif live or dead > 0 then
	redis.call('ZREM', KEYS[6], ARGV[1])
end
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if removed == 1 and ARGV[3] ~= '' then
	local t = redis.call('TIME')
	redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
	local others = redis.call('ZCARD', KEYS[4])
	if others > 0 and redis.call('ZSCORE', KEYS[4], ARGV[8]) then
		others = others - 1
	end
	if others > 0 then
		redis.call('PUBLISH', ARGV[2], ARGV[3])
	end
end
return removed

#!lua
-- Take one permit of a lock, owner-checked, with a fencing counter.
-- KEYS[1] lock: sorted set, member = holder token, score = lease end (ms, Redis TIME)
-- KEYS[2] fence: the key's fencing counter; it expires once the lock is idle
-- KEYS[3] waitq: sorted set of waiting Caddy instances, score = entry expiry (ms)
-- KEYS[4] replay (with ARGV[7] = "1"): the stored answer of an earlier
-- holder, or a run record (ARGV[10])
-- KEYS[5] dead: sorted set of tokens whose attempt was given up while its
-- outcome was unknown (member = token, score = until when, ms): such a
-- token is never granted, so an acquire that reaches Redis after its own
-- undo (a delayed packet) takes nothing
-- ARGV[1] token, ARGV[2] ttl ms, ARGV[3] permits, ARGV[4] instance id,
-- ARGV[5] waitq entry lifetime ms: a busy attempt puts its instance in the
-- wait list, so a release knows whether to announce itself (nobody else
-- waiting: no message)
-- ARGV[6] how many fencing tokens to reserve (>= 1): a lease that this
-- instance will hand on to its own queued waiters without a Redis call uses
-- the block fence-k+1 .. fence, one token per holder
-- Fencing counters never fall below Redis TIME in microseconds, so a counter
-- lost to a restart, a failover to a lagging replica or its own expiry
-- still hands out tokens above every earlier one (given a server clock that
-- does not step back).
-- ARGV[7] "1" when the lock replays stored answers (replay)
-- ARGV[8] "1" when instances take turns (one key on one server; with Redlock
-- or several keys separate wait lists could each favour another instance,
-- and then nobody would get a majority or all keys)
-- KEYS[6] delay: sorted set of lock_delay ends (member = token, score = ms):
-- a lease whose end comes without its holder's release keeps the key (or its
-- permit) from everyone until then; a clean release removes its entry.
-- ARGV[9] this lock's lock_delay in ms (0 = none): a grant writes its entry,
-- the lease's end + the delay
-- ARGV[10] "1" when the request is a run that must happen at most once
-- (replay, an unsafe method): KEYS[4] then holds, until an answer is stored
-- there, the run record "run1\n<token>\n<fingerprint>" of the holder
-- that started it, written by the grant and kept ARGV[12] ms (the replay
-- window); ARGV[11] the request's fingerprint. A run started by another
-- token: while its lease is live the request waits (busy); with no live
-- lease (the holder paused or crashed past its lease, or force-released)
-- the run's outcome is in doubt and the request is refused; another
-- fingerprint is refused at once.
-- Returns {1, fence} when taken (the block's last token); {0, ms until the
-- earliest lease ends, ms since the current holder's grant (-1: unknown),
-- other instances in the wait list} when busy ({0, 0} when it is another
-- instance's turn or the token is dead); {2, 0, answer} when an earlier
-- holder's answer is stored (then nothing is taken: the request is
-- answered with it); {3, ms the run record still lives} when another
-- holder's run is in doubt; {4, 0} when it was started by another request
-- (fingerprint).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ARGV[7] == '1' then
	local stored = redis.call('GET', KEYS[4])
	if stored and string.sub(stored, 1, 5) ~= 'run1\n' then
		if redis.call('ZSCORE', KEYS[5], ARGV[1]) then
			return {0, 0}
		end
		return {2, 0, stored}
	end
	-- A safe method (coalescing) passes a run record by.
	if stored and ARGV[10] == '1' then
		local nl = string.find(stored, '\n', 6, true)
		local holder = string.sub(stored, 6, nl - 1)
		if holder ~= ARGV[1] then
			if string.sub(stored, nl + 1) ~= ARGV[11] then
				return {4, 0}
			end
			local leaseEnd = redis.call('ZSCORE', KEYS[1], holder)
			if not leaseEnd or tonumber(leaseEnd) <= now then
				return {3, redis.call('PTTL', KEYS[4])}
			end
		end
	end
end
-- A grant's run record (see ARGV[10]).
local function runRecord()
	if ARGV[10] == '1' then
		redis.call('SET', KEYS[4], 'run1\n' .. ARGV[1] .. '\n' .. ARGV[11], 'PX', ARGV[12])
	end
end
-- The fencing token: the counter, never below TIME in µs (see the top).
local function fence(expireAt)
	local k = tonumber(ARGV[6])
	local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
	local f = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + k, us + k - 1)
	-- The counter outlives the newest lease by a ttl; after that the time
	-- floor alone keeps tokens increasing.
	redis.call('SET', KEYS[2], string.format('%d', f), 'PXAT', expireAt + ttl)
	return f
end
-- A grant's lock_delay entry: the lease's end + the delay.
local function delayEntry()
	local delay = tonumber(ARGV[9])
	if delay > 0 then
		redis.call('ZADD', KEYS[6], now + ttl + delay, ARGV[1])
		local dl = redis.call('ZRANGE', KEYS[6], -1, -1, 'WITHSCORES')
		redis.call('PEXPIREAT', KEYS[6], tonumber(dl[2]))
	end
end
-- The uncontended path: no lease, no wait list, no dead token and no delay
-- entry on the key (one EXISTS for the four), so the key is free and
-- nothing needs trimming or checking: what the path below would do comes
-- down to the grant's own writes.
if redis.call('EXISTS', KEYS[1], KEYS[3], KEYS[5], KEYS[6]) == 0 then
	redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
	redis.call('PEXPIREAT', KEYS[1], now + ttl)
	local f = fence(now + ttl)
	delayEntry()
	runRecord()
	return {1, f}
end
if redis.call('ZSCORE', KEYS[5], ARGV[1]) then
	return {0, 0}
end
local permits = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local life = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
-- Permits kept by a delay: entries of tokens that hold no lease any more.
local delayed, delayEnd = 0, nil
if redis.call('EXISTS', KEYS[6]) == 1 then
	redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
	local ds = redis.call('ZRANGE', KEYS[6], 0, -1, 'WITHSCORES')
	for i = 1, #ds, 2 do
		if ds[i] ~= ARGV[1] and not redis.call('ZSCORE', KEYS[1], ds[i]) then
			delayed = delayed + 1
			local e = tonumber(ds[i + 1])
			if not delayEnd or e < delayEnd then
				delayEnd = e
			end
		end
	end
end
local free = redis.call('ZCARD', KEYS[1]) + delayed < permits
if free and not held and ARGV[8] == '1' then
	-- Instances take turns: when another instance has waited longer, it goes first.
	local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
	if head and head ~= ARGV[4] then
		redis.call('ZADD', KEYS[3], now + life, ARGV[4])
		redis.call('PEXPIRE', KEYS[3], life)
		return {0, 0}
	end
end
if free or held then
	redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
	local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
	redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
	redis.call('ZREM', KEYS[3], ARGV[4])
	local f = fence(tonumber(last[2]))
	delayEntry()
	runRecord()
	return {1, f}
end
-- Busy: queue this instance and say when the earliest lease ends. An entry
-- lives as long as its instance keeps asking; the instance that asked least
-- recently stands first, so instances take turns.
redis.call('ZADD', KEYS[3], now + life, ARGV[4])
redis.call('PEXPIRE', KEYS[3], life)
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local frees = delayEnd
if first[2] and (not frees or tonumber(first[2]) < frees) then
	frees = tonumber(first[2])
end
local left = (frees or now) - now
-- How long the current holder has held the lock, by this server's clock:
-- the fencing counter is the newest grant's TIME in microseconds (or
-- later: a renewal, a counter written back from a server whose clock is
-- ahead), so the figure is never more than the truth. With permits, the
-- holder that ends first is the one granted (or last extended) first: its
-- lease end minus ttl, where that is earlier. No holder (the key is in its
-- lock_delay): unknown.
local held = -1
local c = tonumber(redis.call('GET', KEYS[2]) or '')
if c and first[2] then
	held = math.max(now - math.floor(c / 1000), 0)
	if permits > 1 then
		held = math.max(held, ttl - (tonumber(first[2]) - now))
	end
end
return {0, left, held, redis.call('ZCARD', KEYS[3]) - 1}

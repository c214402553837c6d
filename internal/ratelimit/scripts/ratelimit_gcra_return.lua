-- redis_ratelimit, algorithm gcra: return an admission (its answer does not
-- count, or its client went away while it waited).
--
-- KEYS[i]  the TAT of rate i (format in ratelimit_gcra.lua).
-- ARGV[1]  the cost c of the admission; then per rate i: n, window w in
--          µs, burst, the TAT the admission R wrote (whole µs) and the
--          key's S then, both from the decision's answer.
--
-- A TAT is one schedule: each admission's units follow those before it,
-- and they drain in that order. Moving the TAT back by x takes x units off
-- the end and moves every later admission's units earlier by x; that is
-- exact when x is at most what is left of R in the current schedule, as if
-- R had cost that much less. R's units end at E = the TAT it wrote minus
-- what admissions ahead of it returned since. The key counts in S the µs
-- ever returned, and keeps its last few returns, newest first, as
-- " P x" each: P = TAT written + S then, of the admission that returned
-- (TAT + S never falls, and grows with every admission, so a smaller P is
-- an admission ahead). Of the S returned since R, those of the kept list
-- that came from behind R do not move E; any other (also one dropped from
-- the list) counts as ahead, so E is never overestimated. R gives back
-- what is left of it before E (and before the TAT), at most c units —
-- unless a request held for a later moment (`wait`) is still waiting on
-- the key: moving its units earlier would break that promise (a newcomer
-- would pass beside it), so then R gives back only while it is the latest
-- on the key (the TAT is E, to the µs dropped by flooring). A waiter is
-- pending exactly while the TAT is beyond now + burst units (a held
-- admission's TAT is its moment + burst units; a plain one's at most now +
-- burst units), so this depends on the key, not on the handler that
-- returns (handlers sharing a key may differ in `wait`).
--
-- A key that expired and was written again restarts S, so its E would be
-- too late. So while an admission is still in its key's schedule (now
-- before the TAT it wrote) the key must not expire: a plain TAT only grows
-- and expires after it; a return lowers the TAT, so the key keeps X, the
-- latest expiry (ms) any of its TATs required, and expires at X at the
-- earliest, also when its TAT is already in the past (a full quota).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local ceil, floor, fmt = math.ceil, math.floor, string.format
local keep = 4 -- returns kept per key
-- Read every rate's key first: a request held on any of them (by any of
-- its rates: the rate that set its moment shows it) makes the return
-- strict on all of them.
local vals, pending = {}, false
for i = 1, #KEYS do
	local a = 5 * i - 3
	local v = redis.call('GET', KEYS[i])
	if v then
		local tat, sum, x, list = tonumber(v), 0, 0, ''
		if not tat then
			local ts, ss, xs, rest = string.match(v, '^(%S+) (%d+) (%d+)(.*)$')
			tat, sum, x, list = tonumber(ts), tonumber(ss), tonumber(xs), rest
		end
		vals[i] = {tat, sum, x, list}
		-- A request held for a later moment (`wait`, on any handler that
		-- shares the key) leaves the TAT of the rate that holds it beyond
		-- now + burst units while it waits; a plain admission never does.
		if tat > now + tonumber(ARGV[a + 2]) * tonumber(ARGV[a + 1]) / tonumber(ARGV[a]) then
			pending = true
		end
	end
end
for i = 1, #KEYS do
	local a = 5 * i - 3
	local wrote, sumThen = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
	local kv = now < wrote and vals[i]
	if kv then
		local tat, sum, x, list = kv[1], kv[2], kv[3], kv[4]
		local pos, back = wrote + sumThen, 0
		-- A smaller S than R saw: the key was reset since (admin API).
		if sum >= sumThen then
			local behind, s = 0, sum
			for p, b in string.gmatch(list, ' (%d+) (%d+)') do
				b = tonumber(b)
				s = s - b -- S before this return
				if s < sumThen then
					break -- returned before R was admitted
				end
				if tonumber(p) > pos then
					behind = behind + b
				end
			end
			local est = wrote - (sum - sumThen - behind)
			local most = cost * tonumber(ARGV[a + 1]) / tonumber(ARGV[a])
			if not pending then
				back = math.min(est, tat) - now
			elseif tat < est + 1 then
				back = tat - now
			end
			back = floor(math.min(back, most))
		end
		if back > 0 then
			local pxat = ceil(tat / 1000)
			if x > pxat then
				pxat = x
			end
			tat = tat - back
			local tv = fmt('%.17g', tat)
			if tat == floor(tat) then
				tv = fmt('%d', tat)
			end
			local out, n = {tv, fmt('%d', sum + back), fmt('%d', pxat), fmt('%d', pos), fmt('%d', back)}, 1
			for e in string.gmatch(list, ' %d+ %d+') do
				if n == keep then
					break
				end
				out[#out + 1], n = string.sub(e, 2), n + 1
			end
			redis.call('SET', KEYS[i], table.concat(out, ' '), 'PXAT', out[3])
		end
	end
end
return 1

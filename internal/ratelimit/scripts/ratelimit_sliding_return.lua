-- redis_ratelimit, algorithm sliding_window: return an admission (its
-- answer does not count, or its client went away while it waited).
--
-- KEYS[i]  the log of rate i (format in ratelimit_sliding.lua).
-- ARGV[1]  T, the time the admission was recorded at; ARGV[2] its cost c;
-- ARGV[2i+1] n, ARGV[2i+2] window w in µs, of rate i.
--
-- The c slots holding T are taken out and the later slots move up, so the
-- log is as if the request had never come. The slots it overwrote in the
-- ring (the oldest) come back with a time no earlier than theirs: they had
-- left the window by T, so they were at most T - w - 1, and no later than
-- any slot kept. So the log is exact again, or a little stricter. The log
-- keeps its expiry. This reads and writes the whole log: O(n).
local HDR = 24
local T = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
for i = 1, #KEYS do
	local n = tonumber(ARGV[2 * i + 1])
	local w = tonumber(ARGV[2 * i + 2])
	local v = redis.call('GET', KEYS[i])
	if v and #v >= HDR then
		local pos = struct.unpack('>d', v)
		local first = math.max(0, pos - n)
		local times = {}
		local removed = 0
		for j = first, pos - 1 do
			local off = HDR + 8 * (j % n)
			local tj = 0
			if off + 8 <= #v then
				tj = struct.unpack('>d', v, off + 1)
			end
			if tj == T and removed < cost then
				removed = removed + 1
			else
				times[#times + 1] = tj
			end
		end
		if removed > 0 then
			local np = pos - removed
			local size = math.min(np, n)
			local fill = T - w - 1
			if times[1] and times[1] < fill then
				fill = times[1]
			end
			local ring = {}
			local last = 0
			for j = np - size, np - 1 do
				local tj = fill
				if j >= first then
					tj = times[j - first + 1]
				end
				ring[j % n + 1] = struct.pack('>d', tj)
				last = tj
			end
			redis.call('SET', KEYS[i], struct.pack('>ddd', np, np - size, last) .. table.concat(ring), 'KEEPTTL')
		end
	end
end
return 1

-- redis_ratelimit, algorithm sliding_window: return an admission (its
-- answer does not count, or its client went away while it waited).
--
-- KEYS[i]  the log of rate i (format in ratelimit_sliding.lua).
-- ARGV[1]  T, the time the admission was recorded at; ARGV[2] its cost c;
-- ARGV[2+i] n of rate i.
--
-- The c slots holding T are taken out and the later slots move up, so the
-- log is as if the request had never come. Slots the ring had dropped
-- already were outside every future window; they come back as time 0. The
-- log keeps its expiry. This reads and writes the whole log: O(n).
local HDR = 24
local T = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
for i = 1, #KEYS do
	local n = tonumber(ARGV[2 + i])
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
			local ring = {}
			for j = np - size, np - 1 do
				local tj = 0
				if j >= first then
					tj = times[j - first + 1]
				end
				ring[j % n + 1] = struct.pack('>d', tj)
			end
			local last = times[#times] or 0
			redis.call('SET', KEYS[i], struct.pack('>ddd', np, np - size, last) .. table.concat(ring), 'KEEPTTL')
		end
	end
end
return 1

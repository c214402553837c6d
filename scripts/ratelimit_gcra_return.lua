-- redis_ratelimit, algorithm gcra: return an admission (its answer does not
-- count, or its client went away while it waited).
--
-- KEYS[i]  the TAT of rate i (format in ratelimit_gcra.lua).
-- ARGV[1]  the cost c of the admission; then per rate i: ARGV[3i-1] n,
--          ARGV[3i] window w in µs, ARGV[3i+1] the TAT the admission wrote
--          (whole µs, from the decision's answer).
--
-- A TAT is one schedule: the units of later admissions follow this one's.
-- So a rate gives its c units back only while this admission is still the
-- latest on it (its TAT is the one it wrote): then they are the last c
-- units of the schedule, and moving the TAT back by them (no further than
-- now: what already passed stays used) frees exactly them. Once a later
-- admission came, its units — and, with `wait`, the moment it was promised
-- — come after these, and taking units from the middle would let a new
-- request in ahead of it (two passing at once, over the limit): then the
-- units stay used, which is stricter, never looser. A TAT that is in the
-- past after the return means a full quota, so the key goes.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
for i = 1, #KEYS do
	local v = redis.call('GET', KEYS[i])
	local wrote = tonumber(ARGV[3 * i + 1])
	if v then
		local tat = tonumber(v)
		if tat >= wrote and tat < wrote + 1 then
			tat = tat - cost * tonumber(ARGV[3 * i]) / tonumber(ARGV[3 * i - 1])
			if tat <= now then
				redis.call('DEL', KEYS[i])
			else
				redis.call('SET', KEYS[i], string.format('%.17g', tat), 'PXAT', math.ceil(tat / 1000))
			end
		end
	end
end
return 1

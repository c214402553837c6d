-- redis_ratelimit, algorithm gcra: return an admission (its answer does not
-- count, or its client went away while it waited).
--
-- KEYS[i]  the TAT of rate i (format in ratelimit_gcra.lua).
-- ARGV[1]  the cost c of the admission; ARGV[2i] n, ARGV[2i+1] window w in
-- µs, of rate i.
--
-- Each TAT moves back by the c units the admission added; a TAT that is
-- then in the past means a full quota, so the key goes.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
for i = 1, #KEYS do
	local v = redis.call('GET', KEYS[i])
	if v then
		local tat = tonumber(v) - cost * tonumber(ARGV[2 * i + 1]) / tonumber(ARGV[2 * i])
		if tat <= now then
			redis.call('DEL', KEYS[i])
		else
			redis.call('SET', KEYS[i], string.format('%.17g', tat), 'PXAT', math.ceil(tat / 1000))
		end
	end
end
return 1

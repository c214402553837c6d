#!lua flags=no-writes
-- Admin API: read a rate limit's state for every rate of one key, at one
-- moment, without recording a request.
-- KEYS[i] the state of rate i (a sliding_window log, or a gcra arrival time:
--         "TAT", or "TAT S X" and the kept returns once a return happened;
--         the Go side reads the TAT)
-- Returns {Redis TIME seconds, microseconds, then each key's value or ""}.
local t = redis.call('TIME')
local out = {tonumber(t[1]), tonumber(t[2])}
for i = 1, #KEYS do
	out[#out + 1] = redis.call('GET', KEYS[i]) or ''
end
return out

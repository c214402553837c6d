-- redis_ratelimit, algorithm sliding_window: charge a rate's log with the
-- admissions an instance made on its own while Redis was unreachable
-- (fail_local), whatever the log holds: they were admitted already.
--
-- KEYS[1]  the log of the rate (format in ratelimit_sliding.lua).
-- KEYS[2]  the charge marker of the instance's local limiter on this key:
--          the highest sequence number of its charges applied here.
-- ARGV[1]  n; ARGV[2] the window w in µs; ARGV[3] how long the marker
--          lives (ms); then triples: the time of an admission (µs, Redis
--          TIME as the instance estimates it), ascending, its cost, and
--          its charge's sequence number (ascending).
--
-- A charge whose sequence number the marker already holds ran before (its
-- answer was lost, and the instance sent it again): it is skipped, so a
-- charge counts once however often it is sent.
--
-- An admission that has left the window (time < now - w) is skipped. The
-- others are written at their time, but after the log's latest slot (times
-- never decrease, two admissions never share one), so the log is exact, or
-- a little stricter. Cost is at most n (the ring holds n slots). Reads and
-- writes the whole log: O(n), once per key after an outage.
-- Returns the slots written.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local HDR = 24
local n, w = tonumber(ARGV[1]), tonumber(ARGV[2])
local pack, unpack = struct.pack, struct.unpack
local v = redis.call('GET', KEYS[1]) or ''
local pos, lo, last = 0, 0, 0
local slots = {}
if #v >= HDR then
	pos, lo, last = unpack('>ddd', v)
	for j = 0, math.floor((#v - HDR) / 8) - 1 do
		slots[j] = string.sub(v, HDR + 8 * j + 1, HDR + 8 * j + 8)
	end
end
local done = tonumber(redis.call('GET', KEYS[2]) or '0')
local top = done
local written = 0
for a = 4, #ARGV - 2, 3 do
	local at, c, seq = tonumber(ARGV[a]), math.min(tonumber(ARGV[a + 1]), n), tonumber(ARGV[a + 2])
	if seq > top then
		top = seq
	end
	if seq > done and at >= now - w and c >= 1 then
		local T = math.max(at, last + 1)
		local rec = pack('>d', T)
		for _ = 1, c do
			slots[pos % n] = rec
			pos = pos + 1
		end
		last, written = T, written + c
	end
end
if top > done then
	redis.call('SET', KEYS[2], string.format('%d', top), 'PX', ARGV[3])
end
if written == 0 then
	return 0
end
local body = {}
for j = 0, math.min(pos, n) - 1 do
	body[#body + 1] = slots[j] or pack('>d', 0)
end
-- The log matters while its newest admission is in a window.
redis.call('SET', KEYS[1], pack('>ddd', pos, lo, last) .. table.concat(body), 'PXAT', string.format('%d', math.ceil((last + w + 1) / 1000)))
return written

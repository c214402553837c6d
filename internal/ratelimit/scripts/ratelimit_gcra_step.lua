-- redis_ratelimit, algorithm gcra: the arithmetic of the generic cell rate
-- algorithm, once for every gcra script that decides or charges (scripts.go
-- puts it in front of ratelimit_gcra.lua and ratelimit_gcra_charge.lua;
-- gcra.go holds the same in Go, and a test runs both on the same inputs).
-- Times in µs; u = w/n is the cost of one unit, tau = burst*u the
-- tolerance.

-- gcra_at is the earliest moment a request of cost may pass on a key whose
-- theoretical arrival time (TAT) is tat.
local function gcra_at(tat, cost, u, tau)
	return tat + cost * u - tau
end

-- gcra_after is the TAT once an admission of cost at the moment at is in it.
local function gcra_after(tat, at, cost, u)
	if at > tat then
		tat = at
	end
	return tat + cost * u
end

-- gcra_left is the quota left at now on a key whose TAT is tat (not before
-- now), 0 to burst, and µs until it grows (0: full). Half a microsecond of
-- slack absorbs the rounding of µs-sized doubles.
local function gcra_left(tat, now, u, tau, burst)
	local debt = tat - now
	local rem = math.floor((tau - debt + 0.5) / u)
	if rem < 0 then
		rem = 0
	elseif rem > burst then
		rem = burst
	end
	if rem >= burst then
		return rem, 0
	end
	return rem, math.max(1, math.ceil(debt - tau + (rem + 1) * u))
end

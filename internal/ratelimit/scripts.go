package ratelimit

import (
	_ "embed"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

// The rate limiter's Lua scripts: two decision scripts (they take a batch,
// see multi.go) and the two that return an admission.
var (
	//go:embed scripts/ratelimit_sliding.lua
	slidingLua string
	//go:embed scripts/ratelimit_gcra.lua
	gcraLua string
	//go:embed scripts/ratelimit_sliding_return.lua
	slidingReturnLua string
	//go:embed scripts/ratelimit_gcra_return.lua
	gcraReturnLua string

	SlidingScript       = redisconn.NewScript(slidingLua)
	GCRAScript          = redisconn.NewScript(gcraLua)
	SlidingReturnScript = redisconn.NewScript(slidingReturnLua)
	GCRAReturnScript    = redisconn.NewScript(gcraReturnLua)
)

// decisionScripts take a batch; other scripts (returning an admission) are
// always sent alone. The value is how many integers a decision's answer
// has per rate (after its first two).
var decisionScripts = map[*redisconn.Script]int{SlidingScript: 2, GCRAScript: 4}

// PerRate is how many integers a decision script's answer has per rate
// (after its first two); 0 for a script that takes no batch.
func PerRate(s *redisconn.Script) int { return decisionScripts[s] }

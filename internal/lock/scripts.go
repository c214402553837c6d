package lock

// The engine's Lua scripts (scripts/), embedded and called through
// redisconn.Script, which never resends a call whose answer was lost.

import (
	_ "embed"
	"strings"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
)

var (
	//go:embed scripts/lock_acquire.lua
	acquireLua string
	//go:embed scripts/lock_extend.lua
	extendLua string
	//go:embed scripts/lock_release.lua
	releaseLua string
	//go:embed scripts/fence_raise.lua
	fenceRaiseLua string
	//go:embed scripts/lock_renew.lua
	renewLua string
	//go:embed scripts/lock_keep_answer.lua
	keepAnswerLua string
	//go:embed scripts/lock_inspect.lua
	inspectLua string
	//go:embed scripts/lock_force_release.lua
	forceReleaseLua string

	acquireScript      = redisconn.NewScript(acquireLua)
	extendScript       = redisconn.NewScript(extendLua)
	releaseScript      = redisconn.NewScript(releaseLua)
	fenceRaiseScript   = redisconn.NewScript(fenceRaiseLua)
	renewScript        = redisconn.NewScript(renewLua)
	keepAnswerScript   = redisconn.NewScript(keepAnswerLua)
	inspectScript      = redisconn.NewScript(inspectLua)
	forceReleaseScript = redisconn.NewScript(forceReleaseLua)
	// releaseStoreScript is the release script without allow-oom, for a
	// release that stores an answer for replay: that one can grow memory.
	releaseStoreScript = redisconn.NewScript(strings.Replace(releaseLua, "#!lua flags=allow-oom\n", "#!lua\n", 1))
)

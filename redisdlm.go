// Package redisdlm gives Caddy Redis-backed distributed locks and rate
// limits, as HTTP handler modules:
//
//   - http.handlers.redis_lock serialises requests per key with a distributed
//     lock (one Redis or a Redlock quorum), hands the upstream a fencing
//     token, executes a request once (replay) and releases the lock when the
//     response is done;
//   - http.handlers.redis_ratelimit admits or rejects requests against
//     per-key limits kept in Redis, exact across every Caddy instance;
//   - http.handlers.redis_fence refuses a stale holder's write in front of
//     the storage;
//   - admin.api.redisdlm lets an operator inspect and fix their state.
//
// Importing this package registers them all (xcaddy's --with
// github.com/caddy-dlm/redisdlm). Each module is a package of its own; the
// layout is described once, in docs/design.md ("Code layout"), and the user
// documentation starts at README.md.
package redisdlm

import (
	_ "github.com/caddy-dlm/redisdlm/redisadmin"     // admin.api.redisdlm
	_ "github.com/caddy-dlm/redisdlm/redisfence"     // http.handlers.redis_fence
	_ "github.com/caddy-dlm/redisdlm/redislock"      // http.handlers.redis_lock
	_ "github.com/caddy-dlm/redisdlm/redisratelimit" // http.handlers.redis_ratelimit
)

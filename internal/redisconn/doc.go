// Package redisconn is the connection layer both engines (internal/lock,
// internal/ratelimit) share: the resolved connection settings and their
// pool key, the addresses' checks and redaction, the go-redis client built
// from the settings and its lifetime (Conn counts its users), the reaper
// of its idle connections, the one way a Lua script is called (never
// resent), and the checks on the first connection to each server (version,
// maxmemory-policy).
//
// It knows nothing of Caddy or HTTP: the Caddy-side configuration
// (redisdlm.RedisConfig) resolves placeholders and converts into Settings.
package redisconn

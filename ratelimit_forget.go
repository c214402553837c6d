package redisdlm

import (
	"sync"

	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
)

// Admin resets across the fleet: the instance whose admin API resets a
// key's quota or lifts its ban publishes it (ratelimit.PublishForget); every
// instance's listener (one per shared client, started with its batcher)
// makes the deny caches of every handler with that prefix forget the key.

// denyRegistry holds the provisioned redis_ratelimit handlers that have a
// deny cache, and that cache.
var denyRegistry struct {
	mu sync.Mutex
	hs map[*RedisRateLimit]*ratelimit.DenyCache
}

// unregisterDeny removes h (its Cleanup).
func unregisterDeny(h *RedisRateLimit) {
	denyRegistry.mu.Lock()
	defer denyRegistry.mu.Unlock()
	delete(denyRegistry.hs, h)
}

// registerDeny adds h (its Provision).
func registerDeny(h *RedisRateLimit) {
	denyRegistry.mu.Lock()
	defer denyRegistry.mu.Unlock()
	if denyRegistry.hs == nil {
		denyRegistry.hs = make(map[*RedisRateLimit]*ratelimit.DenyCache)
	}
	denyRegistry.hs[h] = h.deny
}

// denyForgetter forgets what a reset published by any instance says, in
// every registered deny cache.
type denyForgetter struct{}

// Forget drops id from the deny caches of the handlers under prefix.
func (denyForgetter) Forget(prefix, id string) {
	denyRegistry.mu.Lock()
	defer denyRegistry.mu.Unlock()
	for h, deny := range denyRegistry.hs {
		if h.Prefix == prefix {
			deny.Forget(id)
		}
	}
}

// ForgetAll empties every deny cache (a reset may have been missed).
func (denyForgetter) ForgetAll() {
	denyRegistry.mu.Lock()
	defer denyRegistry.mu.Unlock()
	for _, deny := range denyRegistry.hs {
		deny.Clear()
	}
}

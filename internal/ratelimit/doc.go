// Package ratelimit is the rate-limit engine under redis_ratelimit: the
// batcher that sends the decisions of one Redis client in pipelines (a
// pipeline's decisions as one script call, NOSCRIPT handled, a circuit
// breaker), the reading of a decision's answer, the deny cache, and the
// Lua scripts that decide and return admissions (each decision script is
// one batch driver around an algorithm's body, put together in scripts.go).
//
// It depends on the smallest client interface it needs (Client) and tells
// time through a Clock, so its tests wrap a real client to inject what a
// real Redis cannot (an answer lost after the write) and move time without
// a sleep.
//
// It knows nothing of Caddy or HTTP: the handler (package redisdlm)
// renders keys and rates per request, calls Batcher.Do, and logs the
// breaker's changes it is told of through an Observer.
package ratelimit

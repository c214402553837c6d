package redisdlm

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// luaScript is one of the plugin's Lua scripts. Its calls are never resent
// by go-redis after a transport error: a lock or limit script whose answer
// was lost may have run, and none of them may run twice (a Cluster client
// otherwise resends such a command, whatever MaxRetries says). A MOVED or
// ASK answer, which means the command did not run, is still followed.
// It has no other way to be called (go-redis's own Script methods would
// send commands that may be resent).
type luaScript struct {
	hash, src string
}

func newScript(src string) *luaScript { return &luaScript{hash: redis.NewScript(src).Hash(), src: src} }

// Hash is the script's SHA1, the name EVALSHA calls it by.
func (s *luaScript) Hash() string { return s.hash }

// processor is a client or a pipeline.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// Run is Script.Run without resends: EVALSHA, then EVAL when Redis does not
// know the script (after a restart or SCRIPT FLUSH; NOSCRIPT means it did
// not run).
func (s *luaScript) Run(ctx context.Context, p processor, keys []string, args ...any) *redis.Cmd {
	cmd := s.call(ctx, p, false, keys, args)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = s.call(ctx, p, true, keys, args)
	}
	return cmd
}

// Eval sends (or, on a pipeline, queues) EVAL with the script's text.
func (s *luaScript) Eval(ctx context.Context, p processor, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, p, true, keys, args)
}

func (s *luaScript) call(ctx context.Context, p processor, eval bool, keys []string, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, append(s.head(eval, keys, len(args)), args...)...)
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
	_ = p.Process(ctx, noRetry{cmd})
	return cmd
}

// head starts a call of the script: "evalsha", its SHA1 (or "eval", its
// text), the number of keys and the keys, with room for more arguments.
func (s *luaScript) head(eval bool, keys []string, more int) []any {
	name, script := "evalsha", s.hash
	if eval {
		name, script = "eval", s.src
	}
	a := make([]any, 0, 3+len(keys)+more)
	a = append(a, name, script, len(keys))
	for _, k := range keys {
		a = append(a, k)
	}
	return a
}

// noRetry and noRetryInts are commands go-redis must not resend.
type (
	noRetry     struct{ *redis.Cmd }
	noRetryInts struct{ *redis.IntSliceCmd }
)

func (noRetry) NoRetry() bool     { return true }
func (noRetryInts) NoRetry() bool { return true }

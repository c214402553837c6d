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
type luaScript struct {
	*redis.Script
	src string
}

func newScript(src string) *luaScript { return &luaScript{Script: redis.NewScript(src), src: src} }

// processor is a client or a pipeline.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// Run is Script.Run without resends: EVALSHA, then EVAL when Redis does not
// know the script (after a restart or SCRIPT FLUSH; NOSCRIPT means it did
// not run).
func (s *luaScript) Run(ctx context.Context, p processor, keys []string, args ...any) *redis.Cmd {
	cmd := s.call(ctx, p, "evalsha", s.Hash(), keys, args)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = s.call(ctx, p, "eval", s.src, keys, args)
	}
	return cmd
}

// Eval sends (or, on a pipeline, queues) EVAL with the script's text.
func (s *luaScript) Eval(ctx context.Context, p processor, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, p, "eval", s.src, keys, args)
}

func (s *luaScript) call(ctx context.Context, p processor, name, script string, keys []string, args []any) *redis.Cmd {
	a := make([]any, 0, 3+len(keys)+len(args))
	a = append(a, name, script, len(keys))
	for _, k := range keys {
		a = append(a, k)
	}
	cmd := redis.NewCmd(ctx, append(a, args...)...)
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
	_ = p.Process(ctx, noRetry{cmd})
	return cmd
}

// noRetry and noRetryInts are commands go-redis must not resend.
type (
	noRetry     struct{ *redis.Cmd }
	noRetryInts struct{ *redis.IntSliceCmd }
)

func (noRetry) NoRetry() bool     { return true }
func (noRetryInts) NoRetry() bool { return true }

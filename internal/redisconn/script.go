package redisconn

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// evalArgv is argv (of Argv) as an EVAL with the script's text, in a new
// list (argv may still be in use).
func (s *Script) evalArgv(argv []any) []any {
	return append([]any{evalArg, s.srcArg}, argv[2:]...)
}

// newCmd is the command of a whole argument list (of Argv, or of Head
// and the arguments).
func newCmd(ctx context.Context, argv []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, argv...)
	if n, _ := argv[2].(int); n > 0 {
		cmd.SetFirstKeyPos(3)
	}
	return cmd
}

// process sends (or, on a pipeline, queues) the command of argv, never to
// be resent.
func process(ctx context.Context, p Processor, argv []any) *redis.Cmd {
	cmd := newCmd(ctx, argv)
	_ = p.Process(ctx, NoRetry{cmd})
	return cmd
}

// start is a call's name, script and number of keys, with room for more.
func (s *Script) start(eval bool, nkeys, more int) []any {
	name, script := evalshaArg, s.hashArg
	if eval {
		name, script = evalArg, s.srcArg
	}
	return append(make([]any, 0, 3+more), name, script, nkeys)
}

// The command names, boxed once (not per call).
var evalshaArg, evalArg any = "evalsha", "eval"

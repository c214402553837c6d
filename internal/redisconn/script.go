package redisconn

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// Script is one of the plugin's Lua scripts. Its calls are never resent
// by go-redis after a transport error: a lock or limit script whose answer
// was lost may have run, and none of them may run twice (a Cluster client
// otherwise resends such a command, whatever MaxRetries says). A MOVED or
// ASK answer, which means the command did not run, is still followed.
// It has no other way to be called (go-redis's own Script methods would
// send commands that may be resent).
type Script struct {
	hash, src       string
	hashArg, srcArg any // the same, boxed once (not per call)
}

// NewScript prepares src; nothing is sent until a call.
func NewScript(src string) *Script {
	h := redis.NewScript(src).Hash()
	return &Script{hash: h, src: src, hashArg: h, srcArg: src}
}

// Hash is the script's SHA1, the name EVALSHA calls it by.
func (s *Script) Hash() string { return s.hash }

// Source is the script's text.
func (s *Script) Source() string { return s.src }

// Processor is a client or a pipeline.
type Processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// Run is Script.Run without resends: EVALSHA, then EVAL when Redis does not
// know the script (after a restart or SCRIPT FLUSH; NOSCRIPT means it did
// not run).
func (s *Script) Run(ctx context.Context, p Processor, keys []string, args ...any) *redis.Cmd {
	return s.RunArgv(ctx, p, append(s.Head(false, keys, len(args)), args...))
}

// Eval sends (or, on a pipeline, queues) EVAL with the script's text.
func (s *Script) Eval(ctx context.Context, p Processor, keys []string, args ...any) *redis.Cmd {
	return process(ctx, p, append(s.Head(true, keys, len(args)), args...))
}

// EvalArgv is Eval with the arguments of Argv (which must stay as they
// are until the call is answered).
func (s *Script) EvalArgv(ctx context.Context, p Processor, argv []any) *redis.Cmd {
	return process(ctx, p, s.evalArgv(argv))
}

// Go is RunArgv for a caller that does not wait: done gets the answer
// (see Sender; on NOSCRIPT the EVAL goes the same way). argv is one of
// Argv, and must stay as it is until done runs.
func (s *Script) Go(p Sender, argv []any, spawn func(func()), done func(*redis.Cmd)) {
	cmd := newCmd(context.Background(), argv)
	p.Go(NoRetry{cmd}, func() {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			eval := newCmd(context.Background(), s.evalArgv(argv))
			p.Go(NoRetry{eval}, func() { done(eval) }, spawn)
			return
		}
		done(cmd)
	}, spawn)
}

// Argv is a call's whole argument list, appended to buf[:0]: "evalsha",
// the script's SHA1, the number of keys, the keys (as Head puts them,
// so keys must stay as they are until the call is answered), then args.
// A call that runs often keeps buf in storage it has anyway, with room
// for 3+len(keys)+len(args): the command then makes no list of its own.
func (s *Script) Argv(buf []any, keys []string, args ...any) []any {
	buf = append(buf[:0], evalshaArg, s.hashArg, len(keys))
	for i := range keys {
		buf = append(buf, &keys[i])
	}
	return append(buf, args...)
}

// RunArgv is Run with the arguments of Argv (which must stay as they are
// until it returns).
func (s *Script) RunArgv(ctx context.Context, p Processor, argv []any) *redis.Cmd {
	cmd := process(ctx, p, argv)
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = s.EvalArgv(ctx, p, argv)
	}
	return cmd
}

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

// Head starts a call of the script: "evalsha", its SHA1 (or "eval", its
// text), the number of keys and the keys, with room for more arguments.
// Each key goes in as a *string, which costs no allocation to box: go-redis
// writes it as the string, and routes a Cluster or Ring command by it as
// by a string. keys must stay as they are until the command is answered
// (a MOVED answer, or NOSCRIPT, sends them again).
func (s *Script) Head(eval bool, keys []string, more int) []any {
	a := s.start(eval, len(keys), len(keys)+more)
	for i := range keys {
		a = append(a, &keys[i])
	}
	return a
}

// Arg is a command's argument as the string it stands for (a *string as
// Head and the engines' argument lists pass them, or a string).
func Arg(a any) (string, bool) {
	switch v := a.(type) {
	case string:
		return v, true
	case *string:
		if v != nil {
			return *v, true
		}
	}
	return "", false
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

// NoRetry and NoRetryInts are commands go-redis must not resend.
type (
	NoRetry     struct{ *redis.Cmd }
	NoRetryInts struct{ *redis.IntSliceCmd }
)

// NoRetry tells go-redis never to resend the command.
func (NoRetry) NoRetry() bool { return true }

// NoRetry tells go-redis never to resend the command.
func (NoRetryInts) NoRetry() bool { return true }

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
	cmd := s.call(ctx, p, false, keys, args)
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = s.call(ctx, p, true, keys, args)
	}
	return cmd
}

// Eval sends (or, on a pipeline, queues) EVAL with the script's text.
func (s *Script) Eval(ctx context.Context, p Processor, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, p, true, keys, args)
}

// Go is Run for a caller that does not wait: done gets the answer (see
// Sender; on NOSCRIPT the EVAL goes the same way).
func (s *Script) Go(p Sender, keys []string, args []any, spawn func(func()), done func(*redis.Cmd)) {
	cmd := s.newCmd(context.Background(), false, keys, args)
	p.Go(NoRetry{cmd}, func() {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			eval := s.newCmd(context.Background(), true, keys, args)
			p.Go(NoRetry{eval}, func() { done(eval) }, spawn)
			return
		}
		done(cmd)
	}, spawn)
}

func (s *Script) call(ctx context.Context, p Processor, eval bool, keys []string, args []any) *redis.Cmd {
	cmd := s.newCmd(ctx, eval, keys, args)
	_ = p.Process(ctx, NoRetry{cmd})
	return cmd
}

func (s *Script) newCmd(ctx context.Context, eval bool, keys []string, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, append(s.Head(eval, keys, len(args)), args...)...)
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
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

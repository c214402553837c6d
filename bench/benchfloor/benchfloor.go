// Package benchfloor holds two Caddy HTTP handlers for benchmarking only:
// the least a Redis-backed lock and a Redis-backed rate limit can do per
// request inside Caddy, so that `make bench` can put redis_lock and
// redis_ratelimit beside them in the same run (the cost goals' "floor
// handlers" note). It is not part of the redisdlm plugin; `make bench`
// builds it into a second binary, bin/caddy-ceiling, with bench/benchmutex.
//
//	bench_floor_lock      [batched] <redis address>
//	bench_floor_ratelimit [batched] <redis address>
//
// bench_floor_lock takes the request path as its key with `SET key token NX
// PX 8000` (one round trip), runs the rest of the route, and then releases
// with an owner-checked DEL script in a goroutine of its own (after the
// answer, as redis_lock releases): the pattern of the cost goals' lock
// floor, with no fencing token, no wait, no queue and no fault handling. A
// key found taken is answered 423. Batched, the commands of concurrent
// requests share pipelines (batch.go).
//
// bench_floor_ratelimit sends, per request, an Envoy-style pipeline of
// `INCRBY key 1` and `PEXPIRE key 1000` on the X-Key header's value (one
// round trip, nothing batched across requests) and runs the rest of the
// route: it never rejects. Batched, it does the cost goals' exact floor
// instead: the keys of concurrent requests go in one script call that does
// a GET and a SET … PX of each (batch.go).
//
// Both use one go-redis client per handler, with the plugin's pool
// settings (64 connections, all of them kept idle, no retry).
package benchfloor

import (
	"context"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

func init() {
	caddy.RegisterModule(Lock{})
	caddy.RegisterModule(RateLimit{})
	httpcaddyfile.RegisterHandlerDirective("bench_floor_lock", parseLock)
	httpcaddyfile.RegisterHandlerDirective("bench_floor_ratelimit", parseRateLimit)
	// Where redis_lock and redis_ratelimit are.
	httpcaddyfile.RegisterDirectiveOrder("bench_floor_lock", httpcaddyfile.Before, "request_header")
	httpcaddyfile.RegisterDirectiveOrder("bench_floor_ratelimit", httpcaddyfile.Before, "request_header")
}

// release is the owner-checked DEL of the lock floor.
var release = redis.NewScript(`if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0`)

// newClient is a go-redis client with the plugin's pool settings.
func newClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr: addr, MaxRetries: -1, DisableIdentity: true, Protocol: 2,
		PoolSize: 64, MaxIdleConns: 64, PoolFIFO: true,
		DialTimeout: 2 * time.Second, ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second,
	})
}

// Lock is bench_floor_lock.
type Lock struct {
	Redis   string `json:"redis,omitempty"`
	Batched bool   `json:"batched,omitempty"`

	rc    *redis.Client
	batch *batcher // when Batched
}

// tokens numbers the lock floor's holders (process-wide).
var tokens atomic.Int64

// CaddyModule returns the Caddy module information.
func (Lock) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.bench_floor_lock", New: func() caddy.Module { return new(Lock) }}
}

// Provision opens the client and loads the release script.
func (l *Lock) Provision(caddy.Context) error {
	l.rc = newClient(l.Redis)
	if l.Batched {
		l.batch = newBatcher(pipelineSender(l.rc))
	}
	return release.Load(context.Background(), l.rc).Err()
}

// Cleanup closes the client.
func (l *Lock) Cleanup() error {
	if l.batch != nil {
		l.batch.close()
	}
	return l.rc.Close()
}

// ServeHTTP takes the path's key, runs next, and releases in the background.
func (l *Lock) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	key, token := r.URL.Path, "floor-"+strconv.FormatInt(tokens.Add(1), 10)
	var ok bool
	var err error
	if l.batch != nil {
		cmd := redis.NewBoolCmd(r.Context(), "set", key, token, "px", 8000, "nx")
		err = l.batch.do(&call{cmd: cmd})
		ok = cmd.Val()
	} else {
		ok, err = l.rc.SetNX(r.Context(), key, token, 8*time.Second).Result()
	}
	if err != nil {
		return caddyhttp.Error(http.StatusServiceUnavailable, err)
	}
	if !ok {
		return caddyhttp.Error(http.StatusLocked, nil)
	}
	defer func() {
		if l.batch != nil {
			go l.batch.do(&call{cmd: redis.NewCmd(context.Background(), "evalsha", release.Hash(), 1, key, token)})
		} else {
			go release.EvalSha(context.Background(), l.rc, []string{key}, token)
		}
	}()
	return next.ServeHTTP(w, r)
}

// RateLimit is bench_floor_ratelimit.
type RateLimit struct {
	Redis   string `json:"redis,omitempty"`
	Batched bool   `json:"batched,omitempty"`

	rc    *redis.Client
	batch *batcher // when Batched
}

// CaddyModule returns the Caddy module information.
func (RateLimit) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.bench_floor_ratelimit", New: func() caddy.Module { return new(RateLimit) }}
}

// Provision opens the client.
func (rl *RateLimit) Provision(caddy.Context) error {
	rl.rc = newClient(rl.Redis)
	if rl.Batched {
		rl.batch = newBatcher(exactFloorSender(rl.rc))
		return exactFloor.Load(context.Background(), rl.rc).Err()
	}
	return nil
}

// Cleanup closes the client.
func (rl *RateLimit) Cleanup() error {
	if rl.batch != nil {
		rl.batch.close()
	}
	return rl.rc.Close()
}

// ServeHTTP counts the request in one pipeline and runs next.
func (rl *RateLimit) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	key := r.Header.Get("X-Key")
	if rl.batch != nil {
		if err := rl.batch.do(&call{key: key}); err != nil {
			return caddyhttp.Error(http.StatusServiceUnavailable, err)
		}
		return next.ServeHTTP(w, r)
	}
	p := rl.rc.Pipeline()
	p.IncrBy(r.Context(), key, 1)
	p.PExpire(r.Context(), key, time.Second)
	if _, err := p.Exec(r.Context()); err != nil {
		return caddyhttp.Error(http.StatusServiceUnavailable, err)
	}
	return next.ServeHTTP(w, r)
}

// args reads `<directive> [batched] <redis address>`.
func args(d *caddyfile.Dispenser) (addr string, batched bool, err error) {
	d.Next() // directive name
	a := d.RemainingArgs()
	if len(a) == 2 && a[0] == "batched" {
		batched, a = true, a[1:]
	}
	if len(a) != 1 || a[0] == "batched" {
		return "", false, d.ArgErr()
	}
	if d.NextBlock(0) {
		return "", false, d.Errf("%s takes no block", d.Val())
	}
	return a[0], batched, nil
}

// UnmarshalCaddyfile reads `bench_floor_lock [batched] <redis address>`.
func (l *Lock) UnmarshalCaddyfile(d *caddyfile.Dispenser) (err error) {
	l.Redis, l.Batched, err = args(d)
	return err
}

// UnmarshalCaddyfile reads `bench_floor_ratelimit [batched] <redis address>`.
func (rl *RateLimit) UnmarshalCaddyfile(d *caddyfile.Dispenser) (err error) {
	rl.Redis, rl.Batched, err = args(d)
	return err
}

func parseLock(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	l := new(Lock)
	return l, l.UnmarshalCaddyfile(h.Dispenser)
}

func parseRateLimit(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	rl := new(RateLimit)
	return rl, rl.UnmarshalCaddyfile(h.Dispenser)
}

var (
	_ caddyhttp.MiddlewareHandler = (*Lock)(nil)
	_ caddyhttp.MiddlewareHandler = (*RateLimit)(nil)
	_ caddy.Provisioner           = (*Lock)(nil)
	_ caddy.CleanerUpper          = (*Lock)(nil)
	_ caddy.Provisioner           = (*RateLimit)(nil)
	_ caddy.CleanerUpper          = (*RateLimit)(nil)
	_ caddyfile.Unmarshaler       = (*Lock)(nil)
	_ caddyfile.Unmarshaler       = (*RateLimit)(nil)
)

// Package shared holds the Caddy-side pieces every redisdlm handler module
// uses: the Redis connection settings and the pool of clients shared across
// handlers and config reloads, key templates and their rendering, metrics
// registration and the series of each handler, events, the log bridges, the
// Caddyfile options the directives share, and the registry the admin API
// reads. It imports the engines (internal/lock, internal/ratelimit,
// internal/redisconn) to build what a pooled client holds; no handler
// module imports another, they all import this package.
package shared

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/lock"
	"github.com/caddy-dlm/redisdlm/internal/ratelimit"
	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// DefaultTimeout bounds one Redis call (dial, read and write) unless `timeout` says otherwise.
const DefaultTimeout = 500 * time.Millisecond

// RedisConfig holds the Redis connection settings shared by redis_lock and
// redis_ratelimit. Exactly one of Addresses, Cluster or Sentinels is used;
// with none of them the handler talks to 127.0.0.1:6379.
type RedisConfig struct {
	// Independent Redis servers, as `host:port` or `redis://` / `rediss://`
	// URLs (a URL may carry user, password and db). Several servers on
	// redis_lock form a Redlock quorum and their count must be odd (1, 3, 5
	// or 7); redis_ratelimit takes exactly one. Default: 127.0.0.1:6379.
	Addresses []string `json:"redis,omitempty"`

	// Seed addresses of one Redis Cluster, used instead of `redis`, as
	// `host:port` or `redis://` / `rediss://` URLs. A URL's user and
	// password are the cluster's and win over Username and Password;
	// `rediss://` turns TLS on; the URLs of the list must agree on them.
	// Every script of this plugin touches keys of one hash slot only.
	Cluster []string `json:"cluster,omitempty"`

	// Name of the master monitored by Sentinel; used with `sentinels`
	// instead of `redis`.
	SentinelMaster string `json:"sentinel_master,omitempty"`

	// Sentinel addresses for SentinelMaster, as `host:port` or `redis://` /
	// `rediss://` URLs. A URL's user, password and db are the master's and
	// win over Username, Password and DB (the sentinels are asked without a
	// password); `rediss://` turns TLS on for the master, as TLS does (the
	// sentinels are asked without TLS); the URLs of the list must agree on
	// them.
	Sentinels []string `json:"sentinels,omitempty"`

	// Username for Redis ACL authentication. A username in a URL wins.
	Username string `json:"username,omitempty"`

	// Password for Redis authentication. Placeholders such as
	// `{env.REDIS_PASSWORD}` are replaced at provision time. It is never
	// logged and never appears in an error. A password in a URL wins.
	Password string `json:"password,omitempty"`

	// Database index (not available with Cluster). A db in a URL wins.
	// Default: 0.
	DB int `json:"db,omitempty"`

	// Connect with TLS. `rediss://` URLs turn TLS on by themselves.
	TLS bool `json:"tls,omitempty"`

	// PEM file with the certificate authorities that verify the server's
	// certificate when TLS is on. Setting it turns TLS on. Default: the
	// system's roots.
	TLSCAFile string `json:"tls_ca_file,omitempty"`

	// PEM file with the client certificate presented to Redis, for servers
	// that require one (`tls-auth-clients yes`, Redis's default when TLS is
	// on). Needs TLSClientKeyFile; setting it turns TLS on. Default: no
	// client certificate.
	TLSClientCertFile string `json:"tls_client_cert_file,omitempty"`

	// PEM file with the private key of TLSClientCertFile. Default: none.
	TLSClientKeyFile string `json:"tls_client_key_file,omitempty"`

	// Bound on one Redis call: dial, read and write each. A dead or paused
	// Redis costs a request at most this long per call. Default: 500ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`
}

// Validate checks the settings without dialing. allowRedlock accepts
// several independent `redis` servers (redis_lock); otherwise exactly one
// logical Redis is accepted (redis_ratelimit).
func (c *RedisConfig) Validate(allowRedlock bool) error {
	modes := 0
	if len(c.Addresses) > 0 {
		modes++
	}
	if len(c.Cluster) > 0 {
		modes++
	}
	if len(c.Sentinels) > 0 || c.SentinelMaster != "" {
		modes++
		if c.SentinelMaster == "" || len(c.Sentinels) == 0 {
			return errors.New("sentinel needs a master name and at least one sentinel address")
		}
	}
	if modes > 1 {
		return errors.New("redis, cluster and sentinel are mutually exclusive: use one of them")
	}
	n := len(c.Addresses)
	if !allowRedlock && n > 1 {
		return fmt.Errorf("redis: %d servers given, but this handler takes exactly one logical Redis (one address, a cluster or a sentinel)", n)
	}
	if i, j := redisconn.SameServer(c.Addresses); j >= 0 {
		return redisconn.DuplicateServerError(c.Addresses[i], c.Addresses[j])
	}
	if n > 1 && (n%2 == 0 || n > 7) {
		return fmt.Errorf("redis: %d servers given; a Redlock quorum needs an odd count of 1, 3, 5 or 7 servers, because with an even count a split in half leaves no majority and adds no fault tolerance over one server fewer", n)
	}
	for _, list := range [][]string{c.Addresses, c.Cluster, c.Sentinels} {
		for _, a := range list {
			if err := redisconn.ValidateAddress(a); err != nil {
				return err
			}
		}
	}
	if _, _, err := redisconn.SplitSeeds("cluster", c.Cluster); err != nil {
		return err
	}
	if _, _, err := redisconn.SplitSeeds("sentinel", c.Sentinels); err != nil {
		return err
	}
	if c.DB < 0 {
		return fmt.Errorf("db: must not be negative, got %d", c.DB)
	}
	if c.DB != 0 && len(c.Cluster) > 0 {
		return errors.New("db: Redis Cluster supports only database 0")
	}
	if c.Timeout < 0 {
		return errors.New("timeout: must be positive")
	}
	if (c.TLSClientCertFile == "") != (c.TLSClientKeyFile == "") {
		return errors.New("tls_client_cert: needs both a certificate file and a key file")
	}
	return nil
}

// Resolve replaces placeholders ({env.*} and other global ones) and returns
// one redisconn.Settings per logical Redis: several for a Redlock quorum, one
// otherwise.
func (c *RedisConfig) Resolve() ([]redisconn.Settings, error) {
	repl := caddy.NewReplacer()
	timeout := time.Duration(c.Timeout)
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	base := redisconn.Settings{
		Username: repl.ReplaceAll(c.Username, ""),
		Password: repl.ReplaceAll(c.Password, ""),
		DB:       c.DB,
		TLS:      c.TLS,
		CAFile:   repl.ReplaceAll(c.TLSCAFile, ""),
		CertFile: repl.ReplaceAll(c.TLSClientCertFile, ""),
		KeyFile:  repl.ReplaceAll(c.TLSClientKeyFile, ""),
		Timeout:  timeout,
	}
	base.TLSFiles = redisconn.FilesDigest(base.CAFile, base.CertFile, base.KeyFile)
	replAll := func(in []string) ([]string, error) {
		out := make([]string, len(in))
		for i, a := range in {
			out[i] = repl.ReplaceAll(a, "")
			if out[i] == "" {
				return nil, fmt.Errorf("redis address %q renders empty", a)
			}
			if err := redisconn.ValidateAddress(out[i]); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	switch {
	case len(c.Cluster) > 0:
		addrs, err := replAll(c.Cluster)
		if err != nil {
			return nil, err
		}
		hostports, urls, err := redisconn.SplitSeeds("cluster", addrs)
		if err != nil {
			return nil, err
		}
		s := base
		s.Mode, s.Addrs = "cluster", hostports
		urls.Apply(&s)
		return []redisconn.Settings{s}, nil
	case len(c.Sentinels) > 0:
		addrs, err := replAll(c.Sentinels)
		if err != nil {
			return nil, err
		}
		hostports, urls, err := redisconn.SplitSeeds("sentinel", addrs)
		if err != nil {
			return nil, err
		}
		s := base
		s.Mode, s.Addrs, s.Master = "sentinel", hostports, repl.ReplaceAll(c.SentinelMaster, "")
		urls.Apply(&s)
		return []redisconn.Settings{s}, nil
	}
	list := c.Addresses
	if len(list) == 0 {
		list = []string{"127.0.0.1:6379"}
	}
	addrs, err := replAll(list)
	if err != nil {
		return nil, err
	}
	if i, j := redisconn.SameServer(addrs); j >= 0 {
		// Only placeholders can get here: validate saw the literal ones.
		return nil, fmt.Errorf("%w (once placeholders were replaced)", redisconn.DuplicateServerError(addrs[i], addrs[j]))
	}
	out := make([]redisconn.Settings, len(addrs))
	for i, a := range addrs {
		s := base
		s.Mode, s.Addrs = "single", []string{a}
		out[i] = s
	}
	return out, nil
}

// ClientPool shares one client per identical settings across handlers and
// config reloads; the last user's Cleanup closes it.
var ClientPool = caddy.NewUsagePool()

// Client is one shared Redis client plus what must outlive a config
// reload with it: the lock engine's server (with its Pub/Sub wake-up
// listener) and the rate limiter's pipeline batcher and breaker.
type Client struct {
	Settings redisconn.Settings
	Redis    redis.UniversalClient
	Conn     *redisconn.Conn  // the client's users, shared by both engines
	Lock     *lock.Server     // the lock engine's server (releaser, wake-ups, pipe)
	Check    *redisconn.Check // version, maxmemory-policy and process, per server
	Users    *clientUsers     // the handlers using it, for its parts' log lines

	mu     sync.Mutex
	rl     *ratelimit.Batcher        // made by the first rate-limit call
	forget *ratelimit.ForgetListener // admin resets of other instances; with rl
	closed bool                      // no new batcher: the client is closed
}

// ForgetterOf makes what a client's rate-limit reset listener tells of
// the resets, bans and resubscriptions it hears: the rate-limit handler
// module sets it (its handlers on the client keep the deny caches and
// local limiters those reach).
var ForgetterOf = func(*Client) ratelimit.Forgetter { return nil }

// DestructGrace is how long a client whose last handler went away stays
// open for requests of the old config still on their way to a lock or a
// limit (a reload's old servers finish their requests after Cleanup). A
// var only so that tests can shorten it.
var DestructGrace = 10 * time.Second

// Destruct implements caddy.Destructor: it runs when the last handler using
// this client has been cleaned up.
//
// The client itself closes destructGrace later, once no lock request, rate
// limit call or background release of an old config uses it any more: a
// reload that changes the connection settings must not cut off a request
// of the old config, still in an earlier handler or holding a lock.
func (p *Client) Destruct() error {
	time.AfterFunc(DestructGrace, func() {
		p.Lock.CloseWhenIdle(func() {
			p.mu.Lock()
			p.closed = true
			rl, forget := p.rl, p.forget
			p.mu.Unlock()
			if rl != nil {
				rl.Close()
				forget.Close()
			}
			p.Check.Close()
			_ = p.Redis.Close()
		})
	})
	return nil
}

// RateLimit runs one rate-limit script call: batched with concurrent calls
// into one pipeline, answered within the client's timeout (or when ctx
// ends), and refused at once while the breaker is open. obs is the
// calling handler's: the batcher outlives configs, its log lines do not.
func (p *Client) RateLimit(ctx context.Context, c *ratelimit.Call, obs ratelimit.Observer) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ratelimit.ErrBatcherDone
	}
	if p.rl == nil {
		p.rl = ratelimit.NewBatcher(p.Redis, ratelimit.Options{Workers: ratelimit.Workers, Logger: p.Users.Slogger("rl")})
		p.forget = ratelimit.ListenForget(p.Redis, ForgetterOf(p), p.Check.Restarts, p.Users.Slogger("rl"))
	}
	b := p.rl
	p.mu.Unlock()
	p.Conn.Use() // the client stays open until the call (a settle too) is over
	defer p.Conn.Unuse()
	return b.Do(ctx, c, p.Settings.Timeout, obs)
}

// Batcher returns the rate-limit batcher if one was made (for tests).
func (p *Client) Batcher() *ratelimit.Batcher {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rl
}

// AcquireClient returns the shared client for s, creating it when needed.
// The caller must call releaseClient with the same key in Cleanup.
func AcquireClient(s redisconn.Settings) (*Client, string, error) {
	key := s.PoolKey()
	val, _, err := ClientPool.LoadOrNew(key, func() (caddy.Destructor, error) {
		users := new(clientUsers)
		check := newServerCheck(users, s.Display()) // names a Sentinel group's master
		c, err := s.NewClient(check)
		if err != nil {
			return nil, err
		}
		conn := redisconn.NewConn(c, s.Timeout)
		return &Client{Settings: s, Redis: c, Conn: conn, Lock: newLockServer(key, conn, users), Check: check, Users: users}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return val.(*Client), key, nil
}

// AcquireOne takes the shared client of a handler that uses one logical
// Redis (a server, a Cluster or a Sentinel); dir names the directive in
// errors. The caller gives the key back with releaseClient.
func (c *RedisConfig) AcquireOne(dir string) (*Client, string, time.Duration, error) {
	servers, err := c.Resolve()
	if err != nil {
		return nil, "", 0, fmt.Errorf("%s: %w", dir, err)
	}
	if len(servers) != 1 {
		return nil, "", 0, fmt.Errorf("%s: redis: %d servers given, but this handler takes exactly one logical Redis", dir, len(servers))
	}
	pc, key, err := AcquireClient(servers[0])
	if err != nil {
		return nil, "", 0, fmt.Errorf("%s: loading redis client: %w", dir, err)
	}
	return pc, key, servers[0].Timeout, nil
}

// ReleaseClient gives back a client taken with acquireClient.
func ReleaseClient(key string) {
	if key != "" {
		_, _ = ClientPool.Delete(key)
	}
}

// StatusClientClosedRequest is the status a handler answers (as an error)
// and logs when the client went away while it waited: nothing is written.
const StatusClientClosedRequest = 499

// RetryAfterSeconds renders a wait as a Retry-After value: whole seconds,
// rounded up, at least 1.
func RetryAfterSeconds(d time.Duration) int64 {
	if s := CeilSeconds(d); s > 1 {
		return s
	}
	return 1
}

// Jittered raises d by a random share of it, up to fraction f (0: d as
// it is), so rejected clients do not retry in step.
func Jittered(d time.Duration, f float64) time.Duration {
	if f <= 0 || d <= 0 {
		return d
	}
	return d + time.Duration(rand.Float64()*f*float64(d))
}

// CeilSeconds rounds d up to whole seconds (0 for d <= 0).
func CeilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

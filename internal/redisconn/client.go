package redisconn

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Each client's pool per Redis server: up to PoolSize connections in use
// at once, and as many kept idle, so steady load dials nothing new (with a
// smaller idle cap, every connection handed back beyond it was closed and
// the next call dialled again: a handshake, HELLO and the server check per
// request once more requests were in flight than the cap). The pool
// shrinks after a burst or a slow Redis by time instead: the reaper
// (reaper.go) closes a connection no call used for ConnMaxIdle (plus up to
// two of its sweeps), with or without traffic, and the pool closes one
// idle that long, or older than ConnMaxLifetime (± ConnLifetimeJitter, so
// a burst's connections do not all go at once), when a call next takes
// it. The pool hands out its oldest idle connection first (FIFO): while
// calls take each idle connection within ConnMaxIdle (64 calls a minute
// will do), none is idle, so a burst's surplus then goes by lifetime.
// (Handing out the one used last made five tests fail under -race on a
// loaded machine; not pursued here.)
const PoolSize = 64

var (
	// vars only so that a test can shorten them
	ConnMaxIdle        = time.Minute
	ConnMaxLifetime    = 10 * time.Minute
	ConnLifetimeJitter = time.Minute
)

// NewClient builds (but does not dial) the go-redis client for s; check
// runs on every new connection.
func (s Settings) NewClient(check *Check) (redis.UniversalClient, error) {
	tlsConf, err := s.TLSConfig()
	if err != nil {
		return nil, err
	}
	// The same settings in every mode.
	u := &redis.UniversalOptions{
		Addrs: s.Addrs, MasterName: s.Master, Username: s.Username, Password: s.Password,
		DB: s.DB, TLSConfig: tlsConf, ClientName: s.ClientName,
		DialTimeout: s.Timeout, ReadTimeout: s.Timeout, WriteTimeout: s.Timeout, PoolTimeout: s.Timeout,
		// Lock and limit scripts are not idempotent: never resend one.
		MaxRetries: -1,
		// One dial per attempt: go-redis's default retries a failed dial 5
		// times, 100ms apart, which turns a refused connection into a
		// timeout of the call.
		DialerRetries:         1,
		ContextTimeoutEnabled: true,
		DisableIdentity:       true,
		PoolSize:              PoolSize, MaxIdleConns: PoolSize, PoolFIFO: true,
		ConnMaxIdleTime: ConnMaxIdle, ConnMaxLifetime: ConnMaxLifetime, ConnMaxLifetimeJitter: ConnLifetimeJitter,
		Protocol:  2, // no RESP3 feature is used: skip the push-notification checks per reply
		OnConnect: check.onConnect,
	}
	if addr := s.Addrs[0]; s.Mode != "cluster" && s.Mode != "sentinel" && strings.Contains(addr, "://") {
		// The URL's address, credentials, database, TLS and client name;
		// the directive's where the URL has none. The other settings are
		// the plugin's, whatever the URL's query says.
		o, err := redis.ParseURL(addr)
		if err != nil {
			return nil, fmt.Errorf("invalid redis URL %q", RedactURL(addr))
		}
		u.Addrs, u.ClientName = []string{o.Addr}, o.ClientName
		if o.Username != "" {
			u.Username = o.Username
		}
		if o.Password != "" {
			u.Password = o.Password
		}
		if o.DB != 0 {
			u.DB = o.DB
		}
		if o.TLSConfig != nil {
			if tlsConf != nil {
				// rediss:// with `tls <ca>` or a client certificate: keep
				// the URL's server name, add the files.
				o.TLSConfig.RootCAs, o.TLSConfig.Certificates = tlsConf.RootCAs, tlsConf.Certificates
			}
			u.TLSConfig = o.TLSConfig
		}
	}
	// Every connection (pool, pipeline pool, Pub/Sub, Sentinel) is dialled
	// the go-redis way and watched by the client's reaper.
	u.Dialer = newReaper().dialer(redis.NewDialer(&redis.Options{DialTimeout: u.DialTimeout, TLSConfig: u.TLSConfig}))
	switch s.Mode {
	case "cluster":
		return redis.NewClusterClient(u.Cluster()), nil
	case "sentinel":
		return redis.NewFailoverClient(u.Failover()), nil
	}
	return redis.NewClient(u.Simple()), nil
}

// IsRedisDown reports whether err means Redis could not be reached or did
// not answer in time (as opposed to a script's answer).
func IsRedisDown(err error) bool {
	if err == nil {
		return false
	}
	var re redis.Error
	if errors.As(err, &re) {
		// An error reply from a live server: still a fault, but Redis answered.
		return strings.HasPrefix(re.Error(), "LOADING") || strings.HasPrefix(re.Error(), "CLUSTERDOWN") ||
			strings.HasPrefix(re.Error(), "MASTERDOWN") || strings.HasPrefix(re.Error(), "TRYAGAIN")
	}
	return true
}

// RefusedForNow reports whether msg, an error reply of a live Redis, is a
// refusal that may pass later: out of memory, a read-only replica, busy,
// loading, a master or cluster down, a misconfigured save, too few
// replicas, a slot moving. Redis 7 ends one raised inside a script with
// "script: …, on @user_script:…"; its prefix tells it all the same.
func RefusedForNow(msg string) bool {
	for _, p := range []string{"OOM ", "READONLY ", "BUSY ", "LOADING ", "MASTERDOWN ", "MISCONF ", "NOREPLICAS ", "CLUSTERDOWN ", "TRYAGAIN "} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// ClientName names a client's server in log lines: its address, the
// addresses of a Cluster, or "sentinel" for a Sentinel group.
func ClientName(c redis.UniversalClient) string {
	switch c := c.(type) {
	case *redis.Client:
		if a := c.Options().Addr; a != "FailoverClient" {
			return a
		}
		return "sentinel"
	case *redis.ClusterClient:
		return "cluster " + strings.Join(c.Options().Addrs, ",")
	}
	return ""
}

// Conn is one Redis client as both engines share it: the client, the
// bound of one call, and its users (requests holding or waiting for a
// lock on it, rate-limit calls, background releases). When its owner
// closes it, the client stays open until the last user is done, so a
// config reload never cuts off the release of a lock that an old request
// still holds.
type Conn struct {
	Client  redis.UniversalClient
	Timeout time.Duration // bound of one call

	mu      sync.Mutex
	users   int
	closing bool
	onIdle  func()
}

// NewConn wraps a client; nothing is dialed until the first call.
func NewConn(c redis.UniversalClient, timeout time.Duration) *Conn {
	return &Conn{Client: c, Timeout: timeout}
}

// Use and Unuse count a user of the client.
func (c *Conn) Use() {
	c.mu.Lock()
	c.users++
	c.mu.Unlock()
}

// Unuse ends a use; the last one after CloseWhenIdle closes the client.
func (c *Conn) Unuse() {
	c.mu.Lock()
	c.users--
	idle := c.closing && c.users == 0
	f := c.onIdle
	c.mu.Unlock()
	if idle && f != nil {
		go f()
	}
}

// CloseWhenIdle runs closeClient once no user is left (at once when none
// is); later calls do nothing.
func (c *Conn) CloseWhenIdle(closeClient func()) {
	c.mu.Lock()
	if c.closing {
		c.mu.Unlock()
		return
	}
	c.closing = true
	once := new(sync.Once)
	c.onIdle = func() { once.Do(closeClient) }
	idle := c.users == 0
	f := c.onIdle
	c.mu.Unlock()
	if idle {
		f()
	}
}

package redisconn

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

func (s Settings) newClient(check *Check) (redis.UniversalClient, error) {
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

func isRedisDown(err error) bool {
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

func clientName(c redis.UniversalClient) string {
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

func (c *Conn) closeWhenIdle(closeClient func()) {
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

// Package redisdlm provides two Caddy HTTP handlers backed by Redis:
//
//   - http.handlers.redis_lock serialises requests per key with a distributed
//     lock (single Redis server or a Redlock quorum), hands the upstream a
//     fencing token and releases the lock when the response is done.
//   - http.handlers.redis_ratelimit admits or rejects requests against per-key
//     limits kept in Redis, exact across every Caddy instance sharing it.
//
// The files and what each holds are described once, in docs/design.md
// ("Code layout"); the user documentation starts at README.md.
//
// This file holds what both handlers share: the Redis connection settings and
// the pool of clients (one per identical settings, shared across handlers and
// config reloads).
package redisdlm

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
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

// serverSettings is the resolved connection of one logical Redis (one
// server, one cluster or one sentinel group). Its JSON form is the pool key.
type serverSettings struct {
	Mode     string   `json:"mode"` // "single", "cluster" or "sentinel"
	Addrs    []string `json:"addrs"`
	Master   string   `json:"master,omitempty"`
	Username string   `json:"username,omitempty"`
	Password string   `json:"password,omitempty"`
	DB       int      `json:"db,omitempty"`
	TLS      bool     `json:"tls,omitempty"`
	CAFile   string   `json:"ca_file,omitempty"`
	CertFile string   `json:"cert_file,omitempty"`
	KeyFile  string   `json:"key_file,omitempty"`
	// TLSFiles is a digest of the TLS files' contents: a reload after the
	// files were replaced at the same paths gets a new client.
	TLSFiles string        `json:"tls_files,omitempty"`
	Timeout  time.Duration `json:"timeout"`
	// ClientName comes from the URLs of a cluster or sentinel list (a
	// single server's URL is read in newClient).
	ClientName string `json:"client_name,omitempty"`
}

// poolKey identifies identical settings; the password only enters as a hash.
func (s serverSettings) poolKey() string {
	b, _ := json.Marshal(s)
	sum := sha256.Sum256(b)
	return "redisdlm:" + hex.EncodeToString(sum[:])
}

// display names the server in logs and errors, never with a password.
func (s serverSettings) display() string {
	addrs := make([]string, len(s.Addrs))
	for i, a := range s.Addrs {
		addrs[i] = redactURL(a)
	}
	switch s.Mode {
	case "sentinel":
		return "sentinel " + s.Master + "@" + strings.Join(addrs, ",")
	case "cluster":
		return "cluster " + strings.Join(addrs, ",")
	}
	return strings.Join(addrs, ",")
}

// hasPlaceholder reports whether a value still needs the replacer.
func hasPlaceholder(s string) bool {
	return strings.Contains(s, "{") && strings.Contains(s, "}")
}

// validateAddress checks one `host:port` or redis URL without dialing it.
// Its errors keep their reason and never contain a password.
func validateAddress(addr string) error {
	if hasPlaceholder(addr) {
		return nil
	}
	shown := redactURL(addr)
	if strings.Contains(addr, "://") {
		u, err := url.Parse(addr)
		if err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err // the url.Error repeats the URL, password included
			}
			return fmt.Errorf("invalid redis URL %q: %s", shown, strings.ReplaceAll(err.Error(), addr, shown))
		}
		if u.Scheme != "redis" && u.Scheme != "rediss" {
			return fmt.Errorf("invalid redis URL %q: scheme must be redis:// or rediss://", shown)
		}
		if h := u.Hostname(); h != "" {
			if err := checkHost(h); err != nil {
				return fmt.Errorf("invalid redis URL %q: %v", shown, err)
			}
		}
		if p := u.Port(); p != "" {
			if err := checkPort(p); err != nil {
				return fmt.Errorf("invalid redis URL %q: %v", shown, err)
			}
		}
		if _, err := redis.ParseURL(addr); err != nil {
			if strings.Contains(addr, "@") {
				// go-redis may repeat part of the credentials in its message.
				return fmt.Errorf("invalid redis URL %q: want redis://[user:password@]host[:port][/db]", shown)
			}
			return fmt.Errorf("invalid redis URL %q: %s", shown, strings.ReplaceAll(err.Error(), addr, shown))
		}
		return nil
	}
	const want = "want host:port or a redis:// or rediss:// URL"
	if strings.ContainsAny(addr, "/@") {
		return fmt.Errorf("invalid redis address %q: %s (is the \"://\" of a URL mistyped?)", shown, want)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		var ae *net.AddrError
		if errors.As(err, &ae) {
			return fmt.Errorf("invalid redis address %q: %s; %s", shown, ae.Err, want)
		}
		return fmt.Errorf("invalid redis address %q: %s", shown, want)
	}
	if host == "" {
		return fmt.Errorf("invalid redis address %q: missing host; %s", shown, want)
	}
	if err := checkHost(host); err != nil {
		return fmt.Errorf("invalid redis address %q: %v", shown, err)
	}
	if err := checkPort(port); err != nil {
		return fmt.Errorf("invalid redis address %q: %v", shown, err)
	}
	return nil
}

// checkHost accepts an IP address or a DNS name (letters, digits, '-',
// '_' and '.').
func checkHost(h string) error {
	if net.ParseIP(h) != nil {
		return nil
	}
	for _, r := range h {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("host %q is neither an IP address nor a DNS name", h)
		}
	}
	return nil
}

// checkPort accepts a TCP port number in 1-65535.
func checkPort(p string) error {
	n, err := strconv.Atoi(p)
	if err != nil {
		return fmt.Errorf("port %q is not a number", p)
	}
	if n < 1 || n > 65535 {
		return fmt.Errorf("port %d is out of range 1-65535", n)
	}
	return nil
}

// redactURL hides the password of a redis URL. Of something that is not a
// valid URL but holds an '@', it hides everything before the last '@'.
func redactURL(s string) string {
	// A password with a "/" can make url.Parse read its start as the host
	// (redis://:8123/secret@host) or its end as the path (with an "@" too:
	// redis://u:p@a/b@host): then the last "@" rule below applies.
	_, rest, isURL := strings.Cut(s, "://")
	if u, err := url.Parse(s); err == nil && isURL && (u.User != nil && strings.Count(rest, "@") == 1 || !strings.Contains(rest, "@")) {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
			return u.String()
		}
		if u.User == nil || u.User.Username() == "" {
			return s
		}
		return u.String()
	}
	i := strings.LastIndex(s, "@")
	if i < 0 {
		return s
	}
	j := 0
	if k := strings.Index(s, "//"); k >= 0 && k < i {
		j = k + 2
	}
	return s[:j] + "xxxxx" + s[i:]
}

// serverID names the Redis server that addr points at, so that two
// entries of a Redlock list can be told to be one server: the host
// lowercased (an IP in its canonical form, a DNS name without a trailing
// dot) and the port, 6379 when a URL gives none. Scheme, credentials and
// db do not count: two databases of one server fail together. Names are
// compared, never resolved (localhost and 127.0.0.1 stay apart). ok is
// false for an address that holds a placeholder or is invalid
// (validateAddress reports the latter).
func serverID(addr string) (id string, ok bool) {
	if hasPlaceholder(addr) {
		return "", false
	}
	hostport := addr
	if strings.Contains(addr, "://") {
		o, err := redis.ParseURL(addr)
		if err != nil {
			return "", false
		}
		hostport = o.Addr
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", false
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return "", false
	}
	if ip := net.ParseIP(host); ip != nil {
		host = ip.String()
	} else {
		host = strings.TrimSuffix(strings.ToLower(host), ".")
	}
	return net.JoinHostPort(host, strconv.Itoa(p)), true
}

// sameServer returns the indexes i < j of the first two entries of addrs
// that name one Redis server (serverID), or -1, -1.
func sameServer(addrs []string) (int, int) {
	seen := make(map[string]int, len(addrs))
	for j, a := range addrs {
		id, ok := serverID(a)
		if !ok {
			continue
		}
		if i, dup := seen[id]; dup {
			return i, j
		}
		seen[id] = j
	}
	return -1, -1
}

// duplicateServerError says why a list of independent servers may not
// name one server twice. It never shows a password.
func duplicateServerError(a, b string) error {
	const why = "a Redlock quorum needs independent servers, and a server listed twice would get two votes"
	id, _ := serverID(b)
	if a == b {
		return fmt.Errorf("redis: %q is listed twice; %s", redactURL(a), why)
	}
	return fmt.Errorf("redis: %q and %q are the same Redis server %s (only host and port count, not the db); %s", redactURL(a), redactURL(b), id, why)
}

// seedURLs is what the URLs of a `cluster` or `sentinel` list carry
// besides their addresses; one list names one logical Redis, so its URLs
// must agree on it.
type seedURLs struct {
	username, password, clientName string
	db                             int
	tls                            bool
	urls                           int // how many entries were URLs
}

// splitSeeds turns the entries of a `cluster` or `sentinel` list (sub
// names it) into host:port addresses and returns what their URLs carry:
// user, password, db, client name and TLS (rediss://). Entries that still
// hold a placeholder are returned as they are and do not count. Its errors
// never show a password.
func splitSeeds(sub string, addrs []string) ([]string, seedURLs, error) {
	var got seedURLs
	first := ""
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a
		if hasPlaceholder(a) || !strings.Contains(a, "://") {
			continue
		}
		o, err := redis.ParseURL(a)
		if err != nil {
			return nil, seedURLs{}, fmt.Errorf("%s: invalid redis URL %q", sub, redactURL(a))
		}
		out[i] = o.Addr
		this := seedURLs{username: o.Username, password: o.Password, clientName: o.ClientName, db: o.DB, tls: o.TLSConfig != nil}
		if got.urls == 0 {
			got, first = this, a
		} else if what := seedDiff(got, this); what != "" {
			return nil, seedURLs{}, fmt.Errorf("%s: the URLs %q and %q differ in their %s; the URLs of one %s must carry the same user, password, db, client name and scheme", sub, redactURL(first), redactURL(a), what, sub)
		}
		got.urls++
	}
	if sub == "cluster" && got.db != 0 {
		return nil, seedURLs{}, fmt.Errorf("cluster: %q names db %d, but Redis Cluster supports only database 0", redactURL(first), got.db)
	}
	return out, got, nil
}

// seedDiff names what two URLs of one list disagree on, or "".
func seedDiff(a, b seedURLs) string {
	switch {
	case a.tls != b.tls:
		return "scheme (redis:// or rediss://)"
	case a.username != b.username:
		return "user"
	case a.password != b.password:
		return "password"
	case a.db != b.db:
		return "db"
	case a.clientName != b.clientName:
		return "client name"
	}
	return ""
}

// apply puts what the URLs carry into s: their user and password win over
// the directive's, so does a db other than 0, and rediss:// turns TLS on.
func (u seedURLs) apply(s *serverSettings) {
	if u.username != "" {
		s.Username = u.username
	}
	if u.password != "" {
		s.Password = u.password
	}
	if u.db != 0 {
		s.DB = u.db
	}
	if u.tls {
		s.TLS = true
	}
	s.ClientName = u.clientName
}

// validate checks the settings without dialing. allowRedlock accepts
// several independent `redis` servers (redis_lock); otherwise exactly one
// logical Redis is accepted (redis_ratelimit).
func (c *RedisConfig) validate(allowRedlock bool) error {
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
	if i, j := sameServer(c.Addresses); j >= 0 {
		return duplicateServerError(c.Addresses[i], c.Addresses[j])
	}
	if n > 1 && (n%2 == 0 || n > 7) {
		return fmt.Errorf("redis: %d servers given; a Redlock quorum needs an odd count of 1, 3, 5 or 7 servers, because with an even count a split in half leaves no majority and adds no fault tolerance over one server fewer", n)
	}
	for _, list := range [][]string{c.Addresses, c.Cluster, c.Sentinels} {
		for _, a := range list {
			if err := validateAddress(a); err != nil {
				return err
			}
		}
	}
	if _, _, err := splitSeeds("cluster", c.Cluster); err != nil {
		return err
	}
	if _, _, err := splitSeeds("sentinel", c.Sentinels); err != nil {
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

// filesDigest is the SHA-256 of the named files' contents ("" for none; a
// file that cannot be read counts as empty: tlsConfig reports it).
func filesDigest(names ...string) string {
	sum := sha256.New()
	named := false
	for _, n := range names {
		if n == "" {
			continue
		}
		named = true
		b, _ := os.ReadFile(n)
		fmt.Fprintf(sum, "%s\x00%d\x00", n, len(b))
		sum.Write(b)
	}
	if !named {
		return ""
	}
	return hex.EncodeToString(sum.Sum(nil))
}

// resolve replaces placeholders ({env.*} and other global ones) and returns
// one serverSettings per logical Redis: several for a Redlock quorum, one
// otherwise.
func (c *RedisConfig) resolve() ([]serverSettings, error) {
	repl := caddy.NewReplacer()
	timeout := time.Duration(c.Timeout)
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	base := serverSettings{
		Username: repl.ReplaceAll(c.Username, ""),
		Password: repl.ReplaceAll(c.Password, ""),
		DB:       c.DB,
		TLS:      c.TLS,
		CAFile:   repl.ReplaceAll(c.TLSCAFile, ""),
		CertFile: repl.ReplaceAll(c.TLSClientCertFile, ""),
		KeyFile:  repl.ReplaceAll(c.TLSClientKeyFile, ""),
		Timeout:  timeout,
	}
	base.TLSFiles = filesDigest(base.CAFile, base.CertFile, base.KeyFile)
	replAll := func(in []string) ([]string, error) {
		out := make([]string, len(in))
		for i, a := range in {
			out[i] = repl.ReplaceAll(a, "")
			if out[i] == "" {
				return nil, fmt.Errorf("redis address %q renders empty", a)
			}
			if err := validateAddress(out[i]); err != nil {
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
		hostports, urls, err := splitSeeds("cluster", addrs)
		if err != nil {
			return nil, err
		}
		s := base
		s.Mode, s.Addrs = "cluster", hostports
		urls.apply(&s)
		return []serverSettings{s}, nil
	case len(c.Sentinels) > 0:
		addrs, err := replAll(c.Sentinels)
		if err != nil {
			return nil, err
		}
		hostports, urls, err := splitSeeds("sentinel", addrs)
		if err != nil {
			return nil, err
		}
		s := base
		s.Mode, s.Addrs, s.Master = "sentinel", hostports, repl.ReplaceAll(c.SentinelMaster, "")
		urls.apply(&s)
		return []serverSettings{s}, nil
	}
	list := c.Addresses
	if len(list) == 0 {
		list = []string{"127.0.0.1:6379"}
	}
	addrs, err := replAll(list)
	if err != nil {
		return nil, err
	}
	if i, j := sameServer(addrs); j >= 0 {
		// Only placeholders can get here: validate saw the literal ones.
		return nil, fmt.Errorf("%w (once placeholders were replaced)", duplicateServerError(addrs[i], addrs[j]))
	}
	out := make([]serverSettings, len(addrs))
	for i, a := range addrs {
		s := base
		s.Mode, s.Addrs = "single", []string{a}
		out[i] = s
	}
	return out, nil
}

// tlsConfig reads the CA and client certificate files of s; nil when TLS
// is off (a rediss:// URL turns it on by itself in newClient).
func (s serverSettings) tlsConfig() (*tls.Config, error) {
	if !s.TLS && s.CAFile == "" && s.CertFile == "" {
		return nil, nil
	}
	conf := &tls.Config{MinVersion: tls.VersionTLS12}
	if s.CAFile != "" {
		pem, err := os.ReadFile(s.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls: reading the CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls: CA file %s holds no PEM certificate", s.CAFile)
		}
		conf.RootCAs = pool
	}
	if s.CertFile != "" || s.KeyFile != "" {
		cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls_client_cert: loading %s and %s: %w", s.CertFile, s.KeyFile, err)
		}
		conf.Certificates = []tls.Certificate{cert}
	}
	return conf, nil
}

// Each client's pool per Redis server: up to poolSize connections in use
// at once, and as many kept idle, so steady load dials nothing new (with a
// smaller idle cap, every connection handed back beyond it was closed and
// the next call dialled again: a handshake, HELLO and the server check per
// request once more requests were in flight than the cap). The pool
// shrinks after a burst or a slow Redis by time instead: a connection idle
// for connMaxIdle, or older than connMaxLifetime (± connLifetimeJitter, so
// a burst's connections do not all go at once), is closed when the pool
// next looks at it. go-redis has no background reaper: a call closes up to
// three expired connections before it dials, and the pool hands out its
// oldest idle connection first (FIFO), so the surplus of a burst reaches
// its lifetime and is closed without a new dial while other idle
// connections remain.
const poolSize = 64

var (
	// vars only so that a test can shorten them
	connMaxIdle        = time.Minute
	connMaxLifetime    = 10 * time.Minute
	connLifetimeJitter = time.Minute
)

// newClient builds (but does not dial) the go-redis client for s; check
// runs on every new connection.
func (s serverSettings) newClient(check *serverCheck) (redis.UniversalClient, error) {
	tlsConf, err := s.tlsConfig()
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
		PoolSize:              poolSize, MaxIdleConns: poolSize, PoolFIFO: true,
		ConnMaxIdleTime: connMaxIdle, ConnMaxLifetime: connMaxLifetime, ConnMaxLifetimeJitter: connLifetimeJitter,
		Protocol:  2, // no RESP3 feature is used: skip the push-notification checks per reply
		OnConnect: check.onConnect,
	}
	switch s.Mode {
	case "cluster":
		return redis.NewClusterClient(u.Cluster()), nil
	case "sentinel":
		return redis.NewFailoverClient(u.Failover()), nil
	}
	if addr := s.Addrs[0]; strings.Contains(addr, "://") {
		// The URL's address, credentials, database, TLS and client name;
		// the directive's where the URL has none. The other settings are
		// the plugin's, whatever the URL's query says.
		o, err := redis.ParseURL(addr)
		if err != nil {
			return nil, fmt.Errorf("invalid redis URL %q", redactURL(addr))
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
	return redis.NewClient(u.Simple()), nil
}

// clientPool shares one client per identical settings across handlers and
// config reloads; the last user's Cleanup closes it.
var clientPool = caddy.NewUsagePool()

// pooledClient is one shared Redis client plus what must outlive a config
// reload with it: the lock engine's server (with its Pub/Sub wake-up
// listener) and the rate limiter's pipeline batcher and breaker.
type pooledClient struct {
	settings serverSettings
	client   redis.UniversalClient
	lock     *server
	check    *serverCheck // version and maxmemory-policy, per server

	mu     sync.Mutex
	rl     *rlBatcher // made by the first rate-limit call
	closed bool       // no new batcher: the client is closed
}

// destructGrace is how long a client whose last handler went away stays
// open for requests of the old config still on their way to a lock or a
// limit (a reload's old servers finish their requests after Cleanup). A
// var only so that tests can shorten it.
var destructGrace = 10 * time.Second

// Destruct implements caddy.Destructor: it runs when the last handler using
// this client has been cleaned up.
//
// The client itself closes destructGrace later, once no lock request, rate
// limit call or background release of an old config uses it any more: a
// reload that changes the connection settings must not cut off a request
// of the old config, still in an earlier handler or holding a lock.
func (p *pooledClient) Destruct() error {
	time.AfterFunc(destructGrace, func() {
		p.lock.closeWhenIdle(func() {
			p.mu.Lock()
			p.closed = true
			rl := p.rl
			p.mu.Unlock()
			if rl != nil {
				rl.close()
			}
			p.check.close()
			_ = p.client.Close()
		})
	})
	return nil
}

// rateLimit runs one rate-limit script call: batched with concurrent calls
// into one pipeline, answered within the client's timeout (or when ctx
// ends), and refused at once while the breaker is open. logger is the
// calling handler's: the batcher outlives configs, its log lines do not.
func (p *pooledClient) rateLimit(ctx context.Context, c *rlCall, logger *zap.Logger) ([]int64, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errBatcherDone
	}
	if p.rl == nil {
		p.rl = newBatcher(p.client, batchWorkers)
	}
	b := p.rl
	p.mu.Unlock()
	p.lock.use() // the client stays open until the call (a settle too) is over
	defer p.lock.unuse()
	return b.do(ctx, c, p.settings.Timeout, logger)
}

// batcher returns the rate-limit batcher if one was made (for tests).
func (p *pooledClient) batcher() *rlBatcher {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rl
}

// acquireClient returns the shared client for s, creating it when needed.
// The caller must call releaseClient with the same key in Cleanup.
func acquireClient(s serverSettings) (*pooledClient, string, error) {
	key := s.poolKey()
	val, _, err := clientPool.LoadOrNew(key, func() (caddy.Destructor, error) {
		logger := func() *zap.Logger { return caddy.Log().Named("redisdlm") }
		check := newServerCheck(logger, s.display()) // names a Sentinel group's master
		c, err := s.newClient(check)
		if err != nil {
			return nil, err
		}
		return &pooledClient{settings: s, client: c, lock: newServer(key, c, s.Timeout, logger), check: check}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return val.(*pooledClient), key, nil
}

func releaseClient(key string) {
	if key != "" {
		_, _ = clientPool.Delete(key)
	}
}

// isRedisDown reports whether err means Redis could not be reached or did
// not answer in time (as opposed to a script's answer).
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

// retryAfterSeconds renders a wait as a Retry-After value: whole seconds,
// rounded up, at least 1.
func retryAfterSeconds(d time.Duration) int64 {
	if s := ceilSeconds(d); s > 1 {
		return s
	}
	return 1
}

// checkIPPrefix checks an ip_prefix: none, or IPv4 bits 1-32 and IPv6
// bits 1-128.
func checkIPPrefix(p []int) error {
	switch {
	case len(p) == 0:
		return nil
	case len(p) != 2:
		return fmt.Errorf("want [IPv4 bits, IPv6 bits], got %d numbers", len(p))
	case p[0] < 1 || p[0] > 32:
		return fmt.Errorf("IPv4 bits must be 1-32, got %d (0 would put every client in one bucket)", p[0])
	case p[1] < 1 || p[1] > 128:
		return fmt.Errorf("IPv6 bits must be 1-128, got %d (0 would put every client in one bucket)", p[1])
	}
	return nil
}

// jittered raises d by a random share of it, up to fraction f (0: d as
// it is), so rejected clients do not retry in step.
func jittered(d time.Duration, f float64) time.Duration {
	if f <= 0 || d <= 0 {
		return d
	}
	return d + time.Duration(rand.Float64()*f*float64(d))
}

// ceilSeconds rounds d up to whole seconds (0 for d <= 0).
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

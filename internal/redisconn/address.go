package redisconn

// The addresses of a connection: checked without dialing, compared as
// servers, and shown without a password.

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

func validateAddress(addr string) error {
	if HasPlaceholder(addr) {
		return nil
	}
	shown := RedactURL(addr)
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

func serverID(addr string) (id string, ok bool) {
	if HasPlaceholder(addr) {
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

func sameServer(addrs []string) (int, int) {
	seen := make(map[string]int, len(addrs))
	for j, a := range addrs {
		id, ok := ServerID(a)
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

func splitSeeds(sub string, addrs []string) ([]string, SeedURLs, error) {
	var got SeedURLs
	first := ""
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a
		if HasPlaceholder(a) || !strings.Contains(a, "://") {
			continue
		}
		o, err := redis.ParseURL(a)
		if err != nil {
			return nil, SeedURLs{}, fmt.Errorf("%s: invalid redis URL %q", sub, RedactURL(a))
		}
		out[i] = o.Addr
		this := SeedURLs{username: o.Username, password: o.Password, clientName: o.ClientName, db: o.DB, tls: o.TLSConfig != nil}
		if got.urls == 0 {
			got, first = this, a
		} else if what := seedDiff(got, this); what != "" {
			return nil, SeedURLs{}, fmt.Errorf("%s: the URLs %q and %q differ in their %s; the URLs of one %s must carry the same user, password, db, client name and scheme", sub, RedactURL(first), RedactURL(a), what, sub)
		}
		got.urls++
	}
	if sub == "cluster" && got.db != 0 {
		return nil, SeedURLs{}, fmt.Errorf("cluster: %q names db %d, but Redis Cluster supports only database 0", RedactURL(first), got.db)
	}
	return out, got, nil
}

// seedDiff names what two URLs of one list disagree on, or "".
func seedDiff(a, b SeedURLs) string {
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

func (u SeedURLs) apply(s *Settings) {
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

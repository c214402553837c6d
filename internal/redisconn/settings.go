package redisconn

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"
)

// Settings is the resolved connection of one logical Redis (one
// server, one cluster or one sentinel group). Its JSON form is the pool key.
type Settings struct {
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
	// single server's URL is read in NewClient).
	ClientName string `json:"client_name,omitempty"`
}

// PoolKey identifies identical settings; the password only enters as a hash.
func (s Settings) PoolKey() string {
	b, _ := json.Marshal(s)
	sum := sha256.Sum256(b)
	return "redisdlm:" + hex.EncodeToString(sum[:])
}

// Display names the server in logs and errors, never with a password.
func (s Settings) Display() string {
	addrs := make([]string, len(s.Addrs))
	for i, a := range s.Addrs {
		addrs[i] = RedactURL(a)
	}
	switch s.Mode {
	case "sentinel":
		return "sentinel " + s.Master + "@" + strings.Join(addrs, ",")
	case "cluster":
		return "cluster " + strings.Join(addrs, ",")
	}
	return strings.Join(addrs, ",")
}

// FilesDigest is the SHA-256 of the named files' contents ("" for none; a
// file that cannot be read counts as empty: TLSConfig reports it).
func FilesDigest(names ...string) string {
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

// TLSConfig reads the CA and client certificate files of s; nil when TLS
// is off (a rediss:// URL turns it on by itself in NewClient).
func (s Settings) TLSConfig() (*tls.Config, error) {
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

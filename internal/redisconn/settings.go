package redisconn

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
)

func (s Settings) display() string {
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

func (s Settings) tlsConfig() (*tls.Config, error) {
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

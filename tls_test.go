package redisdlm

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testkit"
)

// testPKI is a CA made at run time with a server certificate for 127.0.0.1
// and a client certificate, as PEM files in a temporary directory.
type testPKI struct {
	CA, ServerCert, ServerKey, ClientCert, ClientKey string
}

func newTestPKI(t testing.TB, name string) testPKI {
	t.Helper()
	dir := t.TempDir()
	write := func(file, typ string, der []byte) string {
		p := filepath.Join(dir, file)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	keyDER := func(k *ecdsa.PrivateKey) []byte {
		b, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	serial := int64(1)
	tmpl := func(cn string) *x509.Certificate {
		serial++
		return &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: cn},
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(24 * time.Hour),
		}
	}
	caKey := newKey()
	ca := tmpl(name + " test CA")
	ca.IsCA, ca.BasicConstraintsValid = true, true
	ca.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	var p testPKI
	p.CA = write("ca.pem", "CERTIFICATE", caDER)
	issue := func(cn string, usage x509.ExtKeyUsage) (certFile, keyFile string) {
		k := newKey()
		c := tmpl(cn)
		c.KeyUsage = x509.KeyUsageDigitalSignature
		c.ExtKeyUsage = []x509.ExtKeyUsage{usage}
		c.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		der, err := x509.CreateCertificate(rand.Reader, c, caCert, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return write(cn+".pem", "CERTIFICATE", der), write(cn+".key", "PRIVATE KEY", keyDER(k))
	}
	p.ServerCert, p.ServerKey = issue("server", x509.ExtKeyUsageServerAuth)
	p.ClientCert, p.ClientKey = issue("client", x509.ExtKeyUsageClientAuth)
	return p
}

// startTLSRedis starts a redis-server with a TLS port beside its plain one
// (the plain one serves the test's own checks). authClients is Redis's
// tls-auth-clients: "yes" requires a client certificate.
func startTLSRedis(t testing.TB, p testPKI, authClients string) (*testRedis, string) {
	t.Helper()
	port := freePort(t)
	r := startRedis(t, "--tls-port", strconv.Itoa(port), "--tls-cert-file", p.ServerCert,
		"--tls-key-file", p.ServerKey, "--tls-ca-cert-file", p.CA, "--tls-auth-clients", authClients)
	return r, "127.0.0.1:" + strconv.Itoa(port)
}

// TestTLSConnections: both handlers work over TLS with `rediss://` and with
// `tls <ca>`, and with a client certificate against a server that demands
// one; the same server refuses the connection without it, and a wrong CA
// fails fast with a certificate error and 503 (not a timeout).
func TestTLSConnections(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t, "good")
	other := newTestPKI(t, "other")
	_, open := startTLSRedis(t, p, "no")
	_, strict := startTLSRedis(t, p, "yes")
	q := strconv.Quote
	ok := []struct{ name, conn string }{
		{"rediss URL", fmt.Sprintf(`"redis":[%s],"tls_ca_file":%s`, q("rediss://"+open), q(p.CA))},
		{"tls ca", fmt.Sprintf(`"redis":[%s],"tls":true,"tls_ca_file":%s`, q(open), q(p.CA))},
		{"client cert", fmt.Sprintf(`"redis":[%s],"tls_ca_file":%s,"tls_client_cert_file":%s,"tls_client_key_file":%s`,
			q(strict), q(p.CA), q(p.ClientCert), q(p.ClientKey))},
		{"client cert, rediss URL", fmt.Sprintf(`"redis":[%s],"tls_ca_file":%s,"tls_client_cert_file":%s,"tls_client_key_file":%s`,
			q("rediss://"+strict), q(p.CA), q(p.ClientCert), q(p.ClientKey))},
	}
	for i, c := range ok {
		t.Run(c.name, func(t *testing.T) {
			up := testkit.NewExclusivityUpstream(time.Millisecond)
			lock := provisionLock(t, fmt.Sprintf(`{%s,"timeout":"2s","wait":"20s"}`, c.conn))
			srv := handlerServer(t, lock, up.ServeHTTP)
			for j := 0; j < 5; j++ {
				if resp, body := get(t, srv.URL+"/tls"); resp == nil || resp.StatusCode != 200 {
					t.Fatalf("lock over TLS: %v %s", resp, body)
				}
			}
			up.Check(t)
			rl := provisionRateLimitJSON(t, fmt.Sprintf(`{%s,"timeout":"2s","fail_closed":true,"rates":[{"requests":2,"window":"1m"}],"key":"tls%d"}`, c.conn, i))
			rls := handlerServer(t, rl, okHandler)
			var codes []int
			for j := 0; j < 3; j++ {
				resp, _ := get(t, rls.URL+"/")
				if resp == nil {
					t.FailNow()
				}
				codes = append(codes, resp.StatusCode)
			}
			if fmt.Sprint(codes) != "[200 200 429]" {
				t.Errorf("rate limit over TLS answered %v, want [200 200 429]", codes)
			}
		})
	}

	fails := []struct{ name, conn, want string }{
		{"wrong CA", fmt.Sprintf(`"redis":[%s],"tls_ca_file":%s`, q("rediss://"+open), q(other.CA)), "certificate"},
		// TLS 1.3 tells a client of its refused certificate only after the
		// handshake: the first write may meet a reset instead of the alert.
		{"no client cert", fmt.Sprintf(`"redis":[%s],"tls":true,"tls_ca_file":%s`, q(strict), q(p.CA)), "certificate|connection reset"},
		{"client cert of another CA", fmt.Sprintf(`"redis":[%s],"tls_ca_file":%s,"tls_client_cert_file":%s,"tls_client_key_file":%s`,
			q(strict), q(p.CA), q(other.ClientCert), q(other.ClientKey)), "certificate|connection reset"},
	}
	for _, c := range fails {
		t.Run(c.name, func(t *testing.T) {
			// A timeout of 5s: a handshake error must answer well before it.
			lock := provisionLock(t, fmt.Sprintf(`{%s,"timeout":"5s","wait":"20s"}`, c.conn))
			srv := handlerServer(t, lock, okHandler)
			start := time.Now()
			resp, body := get(t, srv.URL+"/tls")
			took := time.Since(start)
			if resp == nil {
				t.FailNow()
			}
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Errorf("lock with %s: status %d, want 503", c.name, resp.StatusCode)
			}
			checkFastTLSError(t, "lock with "+c.name, body, c.want, took)
			rl := provisionRateLimitJSON(t, fmt.Sprintf(`{%s,"timeout":"5s","fail_closed":true,"rates":[{"requests":2,"window":"1m"}]}`, c.conn))
			rls := handlerServer(t, rl, okHandler)
			start = time.Now()
			resp, body = get(t, rls.URL+"/")
			if resp == nil {
				t.FailNow()
			}
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Errorf("fail_closed rate limit with %s: status %d, want 503", c.name, resp.StatusCode)
			}
			checkFastTLSError(t, "rate limit with "+c.name, body, c.want, time.Since(start))
		})
	}
}

// checkFastTLSError fails unless err names one of want ("a|b") rather than a
// timeout, and came well before the 5s timeout.
func checkFastTLSError(t *testing.T, what, err, want string, took time.Duration) {
	t.Helper()
	named := false
	for _, w := range strings.Split(want, "|") {
		named = named || strings.Contains(strings.ToLower(err), w)
	}
	if !named || strings.Contains(err, "timeout") {
		t.Errorf("%s: error %q should name the TLS problem (%s), not a timeout", what, err, want)
	}
	if took > 4*time.Second {
		t.Errorf("%s answered after %s; a TLS failure must not wait out the 5s timeout", what, took)
	}
}

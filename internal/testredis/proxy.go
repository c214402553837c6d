package testredis

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
)

// InterceptProxy forwards TCP connections to target; every chunk a
// client sends goes through intercept first, which may hold it, act on the
// two connections, and says whether the chunk is forwarded (false: the
// connection forwards nothing more). It returns the proxy's address.
func InterceptProxy(t testing.TB, target string, intercept func(chunk []byte, client, server net.Conn) bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			t.Cleanup(func() { c.Close(); s.Close() })
			go func() { io.Copy(c, s); c.Close() }()
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if !intercept(buf[:n], c, s) {
							return
						}
						s.Write(buf[:n])
					}
					if err != nil {
						s.Close()
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// CutProxy forwards TCP connections to target until cut: then every
// connection it holds is closed and new ones close at their first write.
type CutProxy struct {
	Addr string
	Cut  atomic.Bool
}

// StartCutProxy starts a CutProxy in front of target, until the test ends.
func StartCutProxy(t testing.TB, target string) *CutProxy {
	t.Helper()
	p := new(CutProxy)
	p.Addr = InterceptProxy(t, target, func(_ []byte, client, server net.Conn) bool {
		if p.Cut.Load() {
			client.Close()
			server.Close()
			return false
		}
		return true
	})
	return p
}

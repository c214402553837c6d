// Package faultproxy is a TCP fault proxy for the soak and the bench: a
// Caddy reaches a Redis through one, so that latency can be added, the link
// blackholed for a while, or every connection reset.
//
//   - latency delays every byte from Caddy to Redis by a set time (the
//     Redis → Caddy direction is left alone, so that a rate-limit admission
//     reaches the checking upstream as soon after Redis decided it as
//     usual: latency there would only shift the upstream's view of Redis
//     time, not test the plugin);
//   - blackhole holds every byte in both directions, and new connections,
//     until it is lifted, like a partition that heals (TCP delivers late,
//     it does not drop);
//   - reset closes every connection with RST.

package faultproxy

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy forwards one loopback port to a target address.
type Proxy struct {
	name    string
	target  string
	ln      net.Listener
	latency atomic.Int64 // nanoseconds, Caddy → Redis
	black   atomic.Bool
	closed  atomic.Bool
	mu      sync.Mutex
	conns   map[*net.TCPConn]struct{}
}

// New starts a proxy to target on a free loopback port.
func New(name, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{name: name, target: target, ln: ln, conns: map[*net.TCPConn]struct{}{}}
	go p.serve()
	return p, nil
}

// Addr is the proxy's own address.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Close stops the proxy and resets its connections.
func (p *Proxy) Close() {
	p.closed.Store(true)
	p.ln.Close()
	p.Reset()
}

func (p *Proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.handle(c.(*net.TCPConn))
	}
}

// waitOpen blocks while the link is blackholed (bounded: the longest
// blackhole the schedule makes is a few seconds).
func (p *Proxy) waitOpen() {
	for p.black.Load() && !p.closed.Load() {
		time.Sleep(5 * time.Millisecond)
	}
}

func (p *Proxy) track(c *net.TCPConn, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if on {
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
}

func (p *Proxy) handle(client *net.TCPConn) {
	p.track(client, true)
	defer p.track(client, false)
	defer client.Close()
	p.waitOpen()
	sc, err := net.DialTimeout("tcp", p.target, time.Second)
	if err != nil {
		client.SetLinger(0) // Redis is down: the client sees a reset
		return
	}
	server := sc.(*net.TCPConn)
	p.track(server, true)
	defer p.track(server, false)
	defer server.Close()
	done := make(chan struct{}, 2)
	go func() { p.pipe(client, server, true); done <- struct{}{} }()
	go func() { p.pipe(server, client, false); done <- struct{}{} }()
	<-done // either side ending ends both
}

type chunk struct {
	b  []byte
	at time.Time
}

// pipe copies src to dst, holding bytes while blackholed and, towards
// Redis (up), delaying each chunk by the latency in force when it arrived.
func (p *Proxy) pipe(src, dst *net.TCPConn, up bool) {
	defer src.Close()
	defer dst.Close()
	ch := make(chan chunk, 256)
	go func() {
		defer close(ch)
		for {
			b := make([]byte, 32<<10)
			n, err := src.Read(b)
			if n > 0 {
				ch <- chunk{b: b[:n], at: time.Now()}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range ch {
		if up {
			if d := time.Duration(p.latency.Load()); d > 0 {
				time.Sleep(time.Until(c.at.Add(d)))
			}
		}
		p.waitOpen()
		if _, err := dst.Write(c.b); err != nil {
			src.Close() // unblocks the reader
			for range ch {
			}
			return
		}
	}
}

// Reset closes every connection through the proxy with RST and returns
// how many there were.
func (p *Proxy) Reset() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.SetLinger(0)
		c.Close()
	}
	return len(p.conns)
}

// SetLatency delays every byte towards the target by d from now on (0:
// none).
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(d)) }

// SetBlackhole holds every byte in both directions, and new connections,
// while on.
func (p *Proxy) SetBlackhole(on bool) { p.black.Store(on) }

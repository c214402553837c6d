package main

// The Redlock figure: every Redis behind a latency proxy that
// adds 1 ms, as on a network, so that the ratio measures the design (all
// servers asked at once, decided by the majority) rather than three
// redis-servers sharing two loopback cores.

import (
	"fmt"
	"strings"
	"time"

	"github.com/caddy-dlm/redisdlm/bench/internal/faultproxy"
)

const proxyLatency = time.Millisecond

type redlockProxyResult struct {
	fast, slow []seqResult // [1 server, 3 servers], each behind +1 ms; slow: one of the three +50 ms
	err        error
}

// runRedlockProxy starts one Caddy with two sites, `redis_lock` on one
// server and on a Redlock of three, every server behind its own proxy, and
// samples both round-robin, each call after a spacer (see spaced): first
// with 1 ms on every proxy, then with one of the three at 50 ms.
func runRedlockProxy(step func(string, ...any), n int) *redlockProxyResult {
	res := &redlockProxyResult{}
	var rs []*redisProc
	var ps []*faultproxy.Proxy
	defer func() {
		for _, p := range ps {
			p.Close()
		}
	}()
	for _, name := range []string{"rlp1", "rlp3a", "rlp3b", "rlp3c"} {
		r, err := startRedis(name)
		if err != nil {
			res.err = err
			return res
		}
		rs = append(rs, r)
		p, err := faultproxy.New(name, r.addr())
		if err != nil {
			res.err = err
			return res
		}
		p.SetLatency(proxyLatency)
		ps = append(ps, p)
	}
	ports := make([]int, 3) // 1 server, 3 servers, the spacers' `respond`
	for i := range ports {
		var err error
		if ports[i], err = freePort(); err != nil {
			res.err = err
			return res
		}
	}
	one, three, base := ports[0], ports[1], ports[2]
	cf := globalOpts("rlp") + lockRespondSite(one, ps[0].Addr()) +
		lockRespondSite(three, strings.Join([]string{ps[1].Addr(), ps[2].Addr(), ps[3].Addr()}, " ")) +
		respondSite(base) // the spacers' route (see spaced)
	if _, err := startCaddy("caddyRLP", cf, one, three, base); err != nil {
		res.err = err
		return res
	}
	lat := []latTarget{
		{name: "redis_lock, 1 server, +1 ms", base: fmt.Sprintf("http://127.0.0.1:%d", one)},
		{name: "redis_lock, 3 servers, +1 ms each", base: fmt.Sprintf("http://127.0.0.1:%d", three)},
	}
	for _, t := range lat {
		sequential("warm", t.base, 20, 5*time.Second)
	}
	urlBase := fmt.Sprintf("http://127.0.0.1:%d", base)
	step("latency: Redlock behind 1 ms proxies, %d requests each, interleaved", n)
	res.fast = interleaved(spaced(urlBase, lat...), n, 30*time.Second)
	ps[3].SetLatency(50 * time.Millisecond)
	lat[1].name = "redis_lock, 3 servers, +1 ms, one of them +50 ms"
	sequential("warm", lat[1].base, 20, 5*time.Second)
	step("latency: the same with one of the three at 50 ms")
	res.slow = interleaved(spaced(urlBase, lat...), n, 30*time.Second)
	return res
}

func printRedlockProxy(p func(string, ...any), r *redlockProxyResult) {
	p("### Redlock behind a latency proxy (+1 ms per server)")
	p("")
	if r.err != nil {
		p("error: %s", oneLine(r.err))
		p("")
		return
	}
	p("| config | median | p99 | n | median ÷ 1 server (same round) | goal |")
	p("|---|---|---|---|---|---|")
	for _, round := range []struct {
		rows []seqResult
		goal float64
	}{{r.fast, 1.2}, {r.slow, 1.25}} {
		one := round.rows[0]
		for i, s := range round.rows {
			if s.err != nil {
				p("| %s | — | — | — | — | error: %s |", s.name, oneLine(s.err))
				continue
			}
			ratio, goal := "1.00", "—"
			if i > 0 && one.err == nil {
				x := float64(s.median) / float64(one.median)
				ratio, goal = fmt.Sprintf("**%.2f**", x), fmt.Sprintf("≤ %.2f %s", round.goal, check(x <= round.goal))
			}
			p("| %s | %s | %s | %d | %s | %s |", s.name, ms(s.median), ms(s.p99), s.n, ratio, goal)
		}
	}
	p("")
	p("- Each Redis is reached through its own TCP proxy (bench/internal/faultproxy) that delays every byte towards Redis by 1 ms, so a round trip costs about 1 ms more, as between hosts. Both sites are in one Caddy process and sampled round-robin, each request after an unmeasured `respond`-only request of the same Caddy and on a new key. The loopback-only Redlock row above (three redis-servers on this machine's two cores, no network) is kept as a note: it measures CPU sharing, not the design.")
	p("")
}

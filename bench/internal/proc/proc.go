// Package proc holds what the bench and soak commands share about child
// processes: free loopback ports and the tail of a log.
package proc

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// FreePort returns a free loopback port p such that p and p+10000 (a
// Cluster node's bus port) are both below the kernel's ephemeral range
// (32768 up): a port from that range may be taken by an outgoing
// connection before a server binds it, or before a killed server restarts
// on it. Each port is handed out once per process.
func FreePort() (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		p := 10000 + rand.IntN(12768)
		if portsGiven[p] || portsGiven[p+10000] || !canBind(p) || !canBind(p+10000) {
			continue
		}
		portsGiven[p], portsGiven[p+10000] = true, true
		return p, nil
	}
	return 0, errors.New("no free loopback port in 10000-22767")
}

// canBind reports whether a loopback port is free at the moment.
func canBind(p int) bool {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

var (
	portsMu    sync.Mutex
	portsGiven = map[int]bool{}
)

// Tail returns the last n lines of the file at path ("" when unreadable).
func Tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

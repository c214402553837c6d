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

// FreePort returns a loopback TCP port that was free a moment ago, below
// the kernel's ephemeral range (32768 up): a port from that range may be
// taken by an outgoing connection before a server binds it, or before a
// killed server restarts on it. Each port is handed out once per process.
func FreePort() (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		p := 20000 + rand.IntN(12000)
		if portsGiven[p] {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		l.Close()
		portsGiven[p] = true
		return p, nil
	}
	return 0, errors.New("no free loopback port in 20000-31999")
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

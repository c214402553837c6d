package lock

// One Redis server (or Cluster, or Sentinel group) as the engine sees it.

import (
	"context"
	"log/slog"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/redisconn"
	"github.com/caddy-dlm/redisdlm/internal/throttle"
	"github.com/redis/go-redis/v9"
)

// Server is one Redis server, or one Cluster or Sentinel group, as the
// engine sees it: a stable id (identical connection settings give the same
// id), the shared client (whose users keep it open, see redisconn.Conn),
// the server's Pub/Sub wake-up listener, and the releases it still owes
// (retried in the background).
type Server struct {
	id     string
	name   string // for log lines: the address (never a password)
	conn   *redisconn.Conn
	client Client // conn's, or a test's wrapper of it
	// pipe batches the acquires and releases of concurrent requests on
	// client (see redisconn.Pipe); an acquire with sync_replicas stays out,
	// since its WAIT must follow its own write on the same connection.
	pipe    redisconn.Pipe
	batch   redisconn.Sender // client through pipe (see setClient)
	timeout time.Duration    // bound of one call: conn's
	wake    *wakeListener
	rel     releaser
	logger  func() *slog.Logger
	// onReleaseFailure, if set, counts a failed release of a lease that
	// was held, or whose acquire outcome is unknown.
	onReleaseFailure func(handler string)
}

// batched is the server's client through its pipe.
func (s *Server) batched() redisconn.Sender { return s.batch }

// setClient sets the client the server calls (conn's, or a test's wrapper
// of it).
func (s *Server) setClient(c Client) {
	s.client = c
	s.batch = s.pipe.Via(c, s.timeout)
}

// masterForKey is a Cluster client's way to the master of a key's slot.
type masterForKey interface {
	MasterForKey(ctx context.Context, key string) (*redis.Client, error)
}

// newServer is NewServer.
func newServer(id string, conn *redisconn.Conn, logger func() *slog.Logger) *Server {
	c := conn.Client
	s := &Server{id: id, name: redisconn.ClientName(c), conn: conn, timeout: conn.Timeout, wake: newWakeListener(c, logger), logger: logger}
	s.setClient(c)
	s.rel.s = s
	s.rel.warn = throttle.New(10 * time.Second)
	return s
}

// closeWhenIdle stops the wake-up listener and runs closeClient once no
// user of the client is left (at once when none is).
func (s *Server) closeWhenIdle(closeClient func()) {
	s.conn.CloseWhenIdle(func() { s.wake.stop(); closeClient() })
}

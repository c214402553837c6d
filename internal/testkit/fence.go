package testkit

import (
	"net/http"
	"strconv"
	"sync"

	"github.com/caddy-dlm/redisdlm/internal/shared"
)

// FenceStorage is the storage behind a redis_fence: it records the fencing
// token (the default fencing header) of every write that reaches it and
// answers 204.
type FenceStorage struct {
	mu     sync.Mutex
	writes []int64
}

func (s *FenceStorage) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	tok, _ := strconv.ParseInt(r.Header.Get(shared.DefaultFencingHeader), 10, 64)
	s.mu.Lock()
	s.writes = append(s.writes, tok)
	s.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// Seen is the tokens of the writes that reached it, in order.
func (s *FenceStorage) Seen() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int64(nil), s.writes...)
}

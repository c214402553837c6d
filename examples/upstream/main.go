// Command upstream is the demo backend behind examples/Caddyfile: a slow
// HTTP server that shows whether redis_lock serialised the requests it
// receives, and how a backend uses the lock's fencing token.
//
// Every request sleeps (-sleep, or ?sleep=300ms per request), then answers
// with a JSON line such as
//
//	{"path":"/profile","resource":"alice","user":"alice","fencing_token":"7",
//	 "in_flight":1,"start":"10:41:03.120","end":"10:41:05.121","status":200}
//
// "in_flight" is the number of requests for the same resource running in
// this process when the request arrived, itself included: 1 means the lock
// serialised them, 2 or more means they overlapped.
//
// The resource is the lock key, which the demo Caddyfile forwards in the
// X-Lock-Key header ({http.redis_lock.key}; several keys are joined with
// ","); without that header the request path is the resource.
//
// Usage:
//
//	go run ./examples/upstream -addr 127.0.0.1:9080 -sleep 2s
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// maxSleep bounds ?sleep= so a typo cannot park a request for hours.
const maxSleep = 5 * time.Minute

// server tracks in-flight requests and fencing tokens per resource.
type server struct {
	sleep         time.Duration
	fencingHeader string

	mu       sync.Mutex
	inFlight map[string]int   // resource -> requests running now
	highest  map[string]int64 // resource -> highest fencing token accepted
}

// reply is the body of every answer.
type reply struct {
	Path         string `json:"path"`
	Resource     string `json:"resource"`
	User         string `json:"user,omitempty"`
	FencingToken string `json:"fencing_token,omitempty"`
	InFlight     int    `json:"in_flight"`
	Start        string `json:"start"`
	End          string `json:"end,omitempty"`
	Status       int    `json:"status"`
	Error        string `json:"error,omitempty"`
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9080", "address to listen on")
	sleep := flag.Duration("sleep", 2*time.Second, "how long each request takes; ?sleep=300ms overrides it per request")
	fencingHeader := flag.String("fencing-header", "Lock-Fencing-Token", "request header carrying the fencing token")
	flag.Parse()

	s := &server{
		sleep:         *sleep,
		fencingHeader: *fencingHeader,
		inFlight:      make(map[string]int),
		highest:       make(map[string]int64),
	}
	srv := &http.Server{
		Addr:              *addr,
		Handler:           s,
		ReadHeaderTimeout: 10 * time.Second,
	}
	log.Printf("demo upstream listening on http://%s (sleep %s per request)", *addr, *sleep)
	log.Fatal(srv.ListenAndServe())
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	resources := lockKeys(r)
	rep := reply{
		Path:         r.URL.Path,
		Resource:     strings.Join(resources, ","),
		User:         r.Header.Get("X-User-ID"),
		FencingToken: r.Header.Get(s.fencingHeader),
		Start:        stamp(start),
	}

	sleep := s.sleep
	if v := r.URL.Query().Get("sleep"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 || d > maxSleep {
			rep.Status, rep.Error = http.StatusBadRequest, fmt.Sprintf("bad sleep %q: want a duration between 0 and %s", v, maxSleep)
			s.answer(w, r, rep)
			return
		}
		sleep = d
	}

	// Fencing: the lock is a lease, and a holder that was paused (GC, VM
	// migration, network partition) can still be running after its lease
	// ran out and the next holder got the lock. The lock alone cannot stop
	// that late writer; the resource can. It remembers the highest token it
	// has accepted and refuses any request carrying a lower one: that
	// request comes from a holder that has already been superseded.
	// A real backend does this check atomically with the write it guards
	// (e.g. "UPDATE ... WHERE fence <= $token"); here the check and the
	// record happen under one mutex when the request arrives.
	//
	// With several keys (an order that locks two inventory items) the lock
	// gives one token that is higher than every token issued before for any
	// of the keys, so the check runs per key.
	var token int64
	hasToken := rep.FencingToken != ""
	if hasToken {
		t, err := strconv.ParseInt(rep.FencingToken, 10, 64)
		if err != nil {
			rep.Status, rep.Error = http.StatusBadRequest, fmt.Sprintf("bad fencing token %q", rep.FencingToken)
			s.answer(w, r, rep)
			return
		}
		token = t
	}

	s.mu.Lock()
	if hasToken {
		for _, res := range resources {
			if h, ok := s.highest[res]; ok && token < h {
				s.mu.Unlock()
				rep.Status = http.StatusConflict
				rep.Error = fmt.Sprintf("stale fencing token %d for %q: %d was already accepted", token, res, h)
				s.answer(w, r, rep)
				return
			}
		}
		for _, res := range resources {
			s.highest[res] = token
		}
	}
	s.inFlight[rep.Resource]++
	rep.InFlight = s.inFlight[rep.Resource]
	s.mu.Unlock()

	defer func() {
		s.mu.Lock()
		if s.inFlight[rep.Resource]--; s.inFlight[rep.Resource] <= 0 {
			delete(s.inFlight, rep.Resource)
		}
		s.mu.Unlock()
	}()

	select {
	case <-time.After(sleep):
	case <-r.Context().Done(): // the client or Caddy gave up
		log.Printf("%s %s resource=%q token=%s canceled after %s", r.Method, r.URL.Path, rep.Resource, rep.FencingToken, time.Since(start).Round(time.Millisecond))
		return
	}
	rep.Status = http.StatusOK
	rep.End = stamp(time.Now())
	s.answer(w, r, rep)
}

// answer writes rep as one JSON line and logs it.
func (s *server) answer(w http.ResponseWriter, r *http.Request, rep reply) {
	log.Printf("%s %s resource=%q token=%s in_flight=%d status=%d %s", r.Method, r.URL.Path, rep.Resource, rep.FencingToken, rep.InFlight, rep.Status, rep.Error)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(rep.Status)
	if err := json.NewEncoder(w).Encode(rep); err != nil {
		log.Printf("writing response: %v", err)
	}
}

// lockKeys returns the resources a request touches: the lock keys Caddy
// forwarded in X-Lock-Key, or else the request path. On a route where
// redis_lock did not run, Caddy's header_up forwards the placeholder
// "{http.redis_lock.key}" unreplaced; that counts as no key.
func lockKeys(r *http.Request) []string {
	var keys []string
	v := r.Header.Get("X-Lock-Key")
	if strings.HasPrefix(v, "{") && strings.HasSuffix(v, "}") {
		v = ""
	}
	for _, k := range strings.Split(v, ",") {
		if k = strings.TrimSpace(k); k != "" {
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		keys = []string{r.URL.Path}
	}
	return keys
}

// stamp formats a time with milliseconds, which is what matters here.
func stamp(t time.Time) string { return t.Format("15:04:05.000") }

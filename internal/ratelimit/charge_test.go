package ratelimit

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// TestFailLocalChargeSentAgain: a charge of local admissions whose call
// failed after it was written is sent again, and counts once in Redis,
// whether the call was lost before Redis ran it (without the second send
// the admissions would never be charged: the fleet could then admit them
// again) or only its answer was lost after Redis ran it (a second send
// without the charge markers would count them twice). A proxy in front of
// the Redis swallows the first charge call, or forwards it and drops the
// connection once Redis has applied it.
func TestFailLocalChargeSentAgain(t *testing.T) {
	t.Parallel()
	for _, algo := range Algorithms() {
		for _, lost := range []string{"request", "answer"} {
			t.Run(algo.Name()+"/"+lost, func(t *testing.T) {
				t.Parallel()
				r := testredis.Start(t)
				rc := r.Client()
				var armed atomic.Bool
				var landed atomic.Bool // the lost answer's charge is in Redis
				var rateKey string     // set before the proxy is armed
				script := algo.chargeScript()
				proxy := testredis.InterceptProxy(t, r.Addr, func(chunk []byte, client, server net.Conn) bool {
					if !bytes.Contains(chunk, []byte(script.Hash())) || !armed.CompareAndSwap(true, false) {
						return true
					}
					// The client's side goes first, so no answer can reach it.
					client.Close()
					if lost == "answer" {
						// Forwarded: the charge lands (its log or TAT
						// appears) while its caller waits in vain.
						server.Write(chunk)
						landed.Store(waitFor(5*time.Second, func() bool { return rc.Exists(context.Background(), rateKey).Val() == 1 }))
					}
					server.Close()
					return false
				})
				pc := redis.NewClient(&redis.Options{Addr: proxy, MaxRetries: -1})
				t.Cleanup(func() { pc.Close() })
				lim := NewLimit("caddy:rl:", algo, LimitOptions{})
				rate := Rate{N: 10, Window: time.Minute}
				const ip = "192.0.2.31"
				rates := lim.LocalRates(ip, lim.Plan([]Rate{rate}, 1))
				rateKey = rates[0].Key
				l := NewLocal(100, time.Now().Add(-time.Second))
				for i := 0; i < 3; i++ {
					if d := l.Admit(rates, 1, 1, time.Now()); !d.Allowed {
						t.Fatalf("local admission %d refused", i)
					}
				}
				// The charge script loaded, so that the first charge call
				// is the one with the charges (not a NOSCRIPT).
				if err := rc.ScriptLoad(context.Background(), script.Source()).Err(); err != nil {
					t.Fatal(err)
				}
				charge := func() error {
					_, err := l.Charge(t.Context(), pc, l.TakeCharges(time.Now()), ChargeOptions{Timeout: 5 * time.Second})
					return err
				}
				used := func() (int64, bool, error) {
					q, err := lim.Peek(t.Context(), rc, ip, []Rate{rate})
					if err != nil {
						return 0, false, err
					}
					return q.States[0].Used, q.States[0].Held, nil
				}
				armed.Store(true)
				if err := charge(); err == nil {
					t.Fatal("the charge whose call was lost reported no error")
				}
				if armed.Load() {
					t.Fatal("the proxy saw no charge call")
				}
				if lost == "answer" {
					// The caller saw its connection drop as soon as the
					// proxy took the call, maybe before the proxy sent it
					// on: wait until it is in Redis.
					if !waitFor(10*time.Second, landed.Load) {
						t.Fatal("the charge whose answer was lost never reached Redis")
					}
					if n, found, err := used(); err != nil || !found || n != 3 {
						t.Fatalf("after the lost answer: Redis holds used %d (%v, %v), want used 3", n, found, err)
					}
				}
				if !waitFor(10*time.Second, func() bool {
					_ = charge()
					return !l.Pending()
				}) {
					t.Fatal("the charges were not sent again")
				}
				if n, found, err := used(); err != nil || !found || n != 3 {
					t.Fatalf("after the second call: Redis holds used %d (%v, %v), want used 3: the 3 local admissions, once", n, found, err)
				}
				// The marker expires with the rate's horizon (plus a minute).
				keys, _ := rc.Keys(context.Background(), "*:charged:*").Result()
				if len(keys) != 1 {
					t.Fatalf("charge markers %v, want one", keys)
				}
				if ttl := rc.PTTL(context.Background(), keys[0]).Val(); ttl <= time.Minute || ttl > 2*time.Minute {
					t.Errorf("charge marker expires in %v, want within the rate's minute plus one", ttl)
				}
			})
		}
	}
}

// replyError is an error reply of a live Redis, as go-redis gives it.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

// TestChargeRefusedForGood: only a charge that a second send would meet
// again is dropped; what happens around an outage (no answer, a lost
// connection, a failover's read-only replica, a loading or busy Redis, out
// of memory) is sent again.
func TestChargeRefusedForGood(t *testing.T) {
	for _, c := range []struct {
		err  error
		drop bool
	}{
		{replyError("WRONGTYPE Operation against a key holding the wrong kind of value script: 1f0a, on @user_script:12."), true},
		{replyError("ERR user_script:30: attempt to compare nil with number script: 1f0a, on @user_script:30."), true},
		{replyError("READONLY You can't write against a read only replica."), false},
		{replyError("LOADING Redis is loading the dataset in memory"), false},
		{replyError("BUSY Redis is busy running a script."), false},
		{replyError("OOM command not allowed when used memory > 'maxmemory'."), false},
		{replyError("OOM command not allowed when used memory > 'maxmemory'. script: 1f0a, on @user_script:40."), false},
		{replyError("READONLY You can't write against a read only replica. script: 1f0a, on @user_script:40."), false},
		{replyError("ERR max number of clients reached"), false},
		{context.DeadlineExceeded, false},
		{io.EOF, false},
	} {
		if got := refusedForGood(c.err); got != c.drop {
			t.Errorf("refusedForGood(%q) = %v, want %v", c.err, got, c.drop)
		}
	}
	var _ redis.Error = replyError("")
}

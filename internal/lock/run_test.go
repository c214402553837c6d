package lock

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-dlm/redisdlm/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// Never twice: under replay, a Run's grant writes a run record that
// refuses every other request for the key until an answer is stored over
// it or the run is cleared; while the holder's lease is live they wait.

func runLocker(t *testing.T, r *testredis.Server, ttl time.Duration) *Locker {
	t.Helper()
	o := testOptions()
	o.TTL, o.Replay = ttl, time.Minute
	l, _ := testLocker(t, []*testredis.Server{r}, o)
	return l
}

// runKey is the replay key's value: the run record, or a stored answer.
func replayValue(t *testing.T, r *testredis.Server, key string) string {
	t.Helper()
	v, _ := r.Client().Get(context.Background(), ReplayKey(key)).Result()
	return v
}

func TestRunRecordRefusesDuplicates(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	l := runLocker(t, r, 300*time.Millisecond)
	ctx := context.Background()
	const key = "caddy:lock:{run}"
	ls, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "fp1"})
	if err != nil {
		t.Fatal(err)
	}
	if v := replayValue(t, r, key); !strings.HasPrefix(v, "run1\n") || !strings.HasSuffix(v, "\nfp1") {
		t.Fatalf("replay key after the grant = %q, want the run record", v)
	}
	if ttl := r.Client().PTTL(ctx, ReplayKey(key)).Val(); ttl < 50*time.Second {
		t.Fatalf("run record lives %v, want the replay window (1m)", ttl)
	}
	// While the lease is live: another fingerprint is refused at once, the
	// same one waits (wait 0: busy).
	if _, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "fp2"}); !errors.Is(err, ErrRunMismatch) {
		t.Fatalf("another request's AcquireRun while the run holds: %v, want ErrRunMismatch", err)
	}
	var busy *BusyError
	if _, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "fp1"}); !errors.As(err, &busy) {
		t.Fatalf("a duplicate while the lease is live: %v, want busy", err)
	}
	// The holder pauses past its lease (no extension): the run is in doubt.
	time.Sleep(400 * time.Millisecond)
	_, err = l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "fp1"})
	var doubt *InDoubtError
	if !errors.As(err, &doubt) || doubt.RecordLeft() < 50*time.Second {
		t.Fatalf("a duplicate once the lease ran out: %v, want in doubt with about a minute left", err)
	}
	// A safe method (no Run) passes the record by.
	other, err := l.Acquire(ctx, []string{key})
	if err != nil {
		t.Fatalf("Acquire (no run) with a record in doubt: %v", err)
	}
	other.Release()
	// The holder comes back: its answer is stored over its own record.
	stored, err := ls.KeepAnswer(ctx, "rdlm1\n{}\nanswer")
	if err != nil || !stored {
		t.Fatalf("KeepAnswer of the run's own holder = %v, %v; want stored", stored, err)
	}
	ls.Release()
	var rp *Replayed
	if _, err := l.AcquireRun(ctx, []string{key}, Run{Fingerprint: "fp1"}); !errors.As(err, &rp) || rp.Answer() != "rdlm1\n{}\nanswer" {
		t.Fatalf("a duplicate after the answer was stored: %v, want it replayed", err)
	}
}

func TestRunRecordClearedOrKept(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	l := runLocker(t, r, 30*time.Second)
	ctx := context.Background()
	// Cleared: the run did not happen; a duplicate runs.
	ls, err := l.AcquireRun(ctx, []string{"caddy:lock:{a}"}, Run{Fingerprint: "f"})
	if err != nil {
		t.Fatal(err)
	}
	ls.ClearRun()
	ls.Release()
	if v := replayValue(t, r, "caddy:lock:{a}"); v != "" {
		t.Fatalf("replay key after a cleared run = %q, want none", v)
	}
	again, err := l.AcquireRun(ctx, []string{"caddy:lock:{a}"}, Run{Fingerprint: "f"})
	if err != nil {
		t.Fatalf("a duplicate after a cleared run: %v, want the lock", err)
	}
	again.ClearRun()
	again.Release()
	// Kept: released without an answer, the run is in doubt.
	ls, err = l.AcquireRun(ctx, []string{"caddy:lock:{b}"}, Run{Fingerprint: "f"})
	if err != nil {
		t.Fatal(err)
	}
	ls.Release()
	var doubt *InDoubtError
	if _, err := l.AcquireRun(ctx, []string{"caddy:lock:{b}"}, Run{Fingerprint: "f"}); !errors.As(err, &doubt) {
		t.Fatalf("a duplicate after a run released without an answer: %v, want in doubt", err)
	}
	// Another holder's answer is never stored over a run record.
	other, err := l.Acquire(ctx, []string{"caddy:lock:{b}"})
	if err != nil {
		t.Fatal(err)
	}
	other.Release()
	if stored, _ := other.KeepAnswer(ctx, "rdlm1\n{}\nx"); stored {
		t.Fatal("KeepAnswer stored another token's answer over a run record")
	}
	if v := replayValue(t, r, "caddy:lock:{b}"); !strings.HasPrefix(v, "run1\n") {
		t.Fatalf("replay key = %q, want the run record still", v)
	}
}

// An attempt whose answer is lost is undone: its run record goes with it,
// so the request's own next attempt (or a duplicate) is not refused as in
// doubt by a run that never started.
func TestRunRecordOfLostAttemptCleared(t *testing.T) {
	t.Parallel()
	r := testredis.Start(t)
	o := testOptions()
	o.Replay = time.Minute
	l, fcs := testLocker(t, []*testredis.Server{r}, o)
	ctx := context.Background()
	var lost atomic.Bool
	fcs[0].setHook(func(cmd redis.Cmder, next func() error) error {
		if s, _ := scriptCall(cmd); s == acquireScript && lost.CompareAndSwap(false, true) {
			if err := next(); err != nil {
				return err
			}
			cmd.SetErr(errLostAnswer) // it ran; the answer is lost
			return errLostAnswer
		}
		return next()
	})
	if _, err := l.AcquireRun(ctx, []string{"caddy:lock:{lost}"}, Run{Fingerprint: "f"}); err == nil {
		t.Fatal("AcquireRun with its answer lost: no error")
	}
	if !waitFor(5*time.Second, func() bool { return replayValue(t, r, "caddy:lock:{lost}") == "" }) {
		t.Fatalf("the run record of an attempt undone stays: %q", replayValue(t, r, "caddy:lock:{lost}"))
	}
	ls, err := l.AcquireRun(ctx, []string{"caddy:lock:{lost}"}, Run{Fingerprint: "f"})
	if err != nil {
		t.Fatalf("the next attempt: %v, want the lock", err)
	}
	ls.Release()
}

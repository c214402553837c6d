package ratelimit

// The registry of algorithms (the Algorithm interface is ratelimit.go's).

import (
	"fmt"
	"strings"
	"time"
)

// algorithms are the algorithms a config may name, the first the default.
// A new algorithm is one line here.
var algorithms = []Algorithm{SlidingWindow, GCRA}

// algorithmNamed is AlgorithmNamed.
func algorithmNamed(name string) (Algorithm, error) {
	if name == "" {
		return algorithms[0], nil
	}
	names := make([]string, len(algorithms))
	for i, a := range algorithms {
		if a.Name() == name {
			return a, nil
		}
		names[i] = a.Name()
	}
	return nil, fmt.Errorf("want %s, got %q", strings.Join(names, " or "), name)
}

// checkRate is the rule every rate keeps (CheckRate).
func checkRate(r Rate) error {
	if r.N < 1 {
		return fmt.Errorf("requests must be a whole number >= 1, got %d", r.N)
	}
	if r.Window < time.Millisecond {
		return fmt.Errorf("window must be at least 1ms, got %s", r.Window)
	}
	return nil
}

// localStep is an algorithm's local decision of one rate: whether it
// admits, the quota left at the share and when it grows, how long until it
// would admit (0: never at this share) and the share of n.
type localStep struct {
	ok          bool
	rem, share  int64
	wait, reset time.Duration
}

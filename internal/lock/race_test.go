//go:build race

package lock

// raceEnabled: the tests run under the race detector, whose
// instrumentation changes what escapes to the heap.
const raceEnabled = true

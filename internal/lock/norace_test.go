//go:build !race

package lock

// raceEnabled: the tests run under the race detector (see race_test.go).
const raceEnabled = false

package redisconn

import "testing"

func TestVersionAtLeast(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{"7.0.15": true, "7.2.4": true, "8.0.0": true, "6.2.14": false, "6.9": false, "< 6.0": false, "": false, "x.y": false} {
		if got := versionAtLeast(v, [2]int{7, 0}); got != want {
			t.Errorf("versionAtLeast(%q, 7.0) = %v, want %v", v, got, want)
		}
	}
}

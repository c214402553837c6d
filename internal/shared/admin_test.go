package shared

import (
	"slices"
	"strings"
	"testing"
)

// TestAdminServerNaturalOrder: handler positions follow the servers in
// natural order (srv2 before srv10).
func TestAdminServerNaturalOrder(t *testing.T) {
	t.Parallel()
	names := []string{"srv10", "srv2", "srv1", "api", "srv0", "srv"}
	slices.SortStableFunc(names, naturalCompare)
	if got := strings.Join(names, " "); got != "api srv srv0 srv1 srv2 srv10" {
		t.Fatalf("order %q", got)
	}
}

package bench

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The command name in /proc/<pid>/stat may hold spaces and ')': fields
// count from the last ')'.
func TestParseStatCPU(t *testing.T) {
	stat := "4242 (kv act)ors) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 75 0 0 20 0 9 0 100 1000 200\n"
	got, err := parseStatCPU([]byte(stat))
	require.NoError(t, err)
	require.InDelta(t, 3.25, got, 1e-9)

	for _, bad := range []string{"", "4242 (x S 1", "4242 (x) S 1 2", "4242 (x) S 1 4242 4242 0 -1 1 1 0 0 0 u 75"} {
		_, err := parseStatCPU([]byte(bad))
		require.Error(t, err, "%q", bad)
	}
}

package testkit

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Mapping is one mapping of this process, as /proc/self/maps lists it:
// bytes [Off, Off+Len) of its file.
type Mapping struct {
	Off, Len int64
}

// Mappings lists this process's mappings of the file at path (symlinks in
// path resolved), in address order: what the kernel really maps, for tests
// that check a backend maps what it should and nothing more.
func Mappings(t testing.TB, path string) []Mapping {
	t.Helper()
	real, err := filepath.EvalSymlinks(path)
	require.NoError(t, err)
	data, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	var out []Mapping
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// start-end perms offset dev inode path
		f := strings.Fields(sc.Text())
		if len(f) < 6 || strings.Join(f[5:], " ") != real {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		require.True(t, ok, "maps line %q", sc.Text())
		start, err := strconv.ParseUint(lo, 16, 64)
		require.NoError(t, err)
		end, err := strconv.ParseUint(hi, 16, 64)
		require.NoError(t, err)
		off, err := strconv.ParseInt(f[2], 16, 64)
		require.NoError(t, err)
		out = append(out, Mapping{Off: off, Len: int64(end - start)})
	}
	require.NoError(t, sc.Err())
	return out
}

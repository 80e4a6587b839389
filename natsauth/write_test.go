package natsauth

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A Write that fails partway (here a secret file that exists already)
// leaves nothing of its own: not the configuration, whose keys match
// secrets no one has, nor the secrets written before the failure, which
// would also make every retry fail on them. What was there stays.
func TestWriteThatFailsLeavesNothing(t *testing.T) {
	g, err := Generate(Options{Engines: []string{"e1", "e2"}, Routers: []string{"r1"}})
	require.NoError(t, err)
	dir := t.TempDir()
	last := filepath.Join(dir, g.Creds[len(g.Creds)-1].SecretFile())
	require.NoError(t, os.WriteFile(last, []byte("someone else's\n"), 0o600))
	paths, err := g.Write(dir)
	require.Error(t, err)
	require.Empty(t, paths)
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range left {
		names = append(names, e.Name())
	}
	require.Equal(t, []string{filepath.Base(last)}, names, "left behind")
	b, err := os.ReadFile(last)
	require.NoError(t, err)
	require.Equal(t, "someone else's\n", string(b), "never overwritten")

	// Once it is out of the way, the retry writes the whole set.
	require.NoError(t, os.Remove(last))
	paths, err = g.Write(dir)
	require.NoError(t, err)
	require.Len(t, paths, 1+len(g.Creds))
	for _, p := range paths {
		st, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), p)
	}
	seed, err := os.ReadFile(last)
	require.NoError(t, err)
	require.Equal(t, g.Creds[len(g.Creds)-1].Seed+"\n", string(seed))
}

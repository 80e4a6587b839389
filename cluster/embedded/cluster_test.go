package embedded

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestStartRefusesTooFewServersOrNoStore(t *testing.T) {
	_, err := Start(Options{Servers: 1, Dir: t.TempDir()})
	require.ErrorContains(t, err, "need 2 or more")
	_, err = Start(Options{Servers: 3})
	require.ErrorContains(t, err, "no store directory")
}

// The cluster forms, forms again after a server's restart, and Stop and
// Restart refuse the wrong state.
func TestFormsStopsAndRestarts(t *testing.T) {
	c, err := Start(Options{Servers: 3, Dir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(c.Close) // registered after TempDir: runs first
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, c.WaitFormed(ctx))
	require.Equal(t, 3, c.Size())
	require.Contains(t, c.URLs(1), c.URL(1)+",")

	require.NoError(t, c.Stop(1))
	require.Error(t, c.Stop(1), "already stopped")
	require.Nil(t, c.Server(1))
	require.NoError(t, c.Restart(1))
	require.Error(t, c.Restart(1), "already running")
	require.NoError(t, c.WaitFormed(ctx))

}

package cluster

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// The table follows claims, releases, lapses (the servers' expiry marker)
// and stray records, on a node watching from another server.
func TestOwnerTableFollowsClaimsReleasesAndLapses(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	a := openOwners(t, c.Connect(0), "gpu-0", "", 3)
	b := openOwners(t, c.Connect(1), "gpu-1", "", 3)
	ctx := ctxT(t)
	_, err := a.Resolve(ctx, "before", Request{Register: true, Local: true})
	require.NoError(t, err)

	watcher := openOwners(t, c.Connect(2), "gpu-2", "", 3)
	table, err := watcher.WatchOwners(ctx)
	require.NoError(t, err)
	t.Cleanup(table.Stop)
	// Initial values are in once WatchOwners returns... on this replica,
	// which may lag the write's quorum: allow it to catch up.
	want := func(node string, engines ...string) func() error {
		return func() error {
			if got := table.ByNode()[node]; !slices.Equal(got, engines) {
				return fmt.Errorf("node %s owns %v in the table, want %v", node, got, engines)
			}
			return nil
		}
	}
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, want("gpu-0", "before"))

	_, err = b.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, want("gpu-1", "e1"))
	require.Equal(t, b.Revision("e1"), table.Get("e1").Revision)

	require.NoError(t, b.Release(ctx, "e1"))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, want("gpu-1"))
	require.Nil(t, table.Get("e1"))

	// "before" is never renewed: it lapses, and the marker removes it.
	testkit.Eventually(t, 5*testLease, 20*time.Millisecond, want("gpu-0"))

	// A stray value is counted and left out.
	js, err := jetstream.New(c.Connect(0))
	require.NoError(t, err)
	kv, err := js.KeyValue(ctx, "kvactors_owners")
	require.NoError(t, err)
	_, err = kv.Put(ctx, "stray", []byte(`{"node":""}`))
	require.NoError(t, err)
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if table.BadRecords() != 1 {
			return fmt.Errorf("%d bad records, want 1", table.BadRecords())
		}
		return nil
	})
	require.Nil(t, table.Get("stray"))
}

package store

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// kvactors_pool_hits_total counts chunks a load copied out of host memory:
// a load that fails (a device fault, a corrupt chunk) counts none, one that succeeds counts each host chunk once.
func TestPoolHitsCountOnlyCopiedLoads(t *testing.T) {
	s, e, dev, m := fixture(t, 2, 16<<10, 0)
	storeChunks(t, e, chunk("a", 1, 2), chunk("b", 3, 4))
	load := func() error {
		t.Helper()
		_, err := e.PrepareLoad([]messages.Key{"a", "b"})
		require.NoError(t, err)
		return e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 10, 11), chunk("b", 12, 13)}, nil)
	}

	dev.fail = errors.New("dma fault")
	require.ErrorContains(t, load(), "dma fault")
	require.Zero(t, testutil.ToFloat64(m.PoolHits), "a failed device copy is no hit")
	dev.fail = nil

	require.NoError(t, load())
	require.Equal(t, 2.0, testutil.ToFloat64(m.PoolHits), "each chunk of a copied load, once")

	loc, err := s.pool.Locate([]messages.Key{"b"})
	require.NoError(t, err)
	s.arena.Bytes()[loc.Ext[0].Off] ^= 1
	require.ErrorIs(t, load(), ErrCorrupt)
	require.Equal(t, 2.0, testutil.ToFloat64(m.PoolHits), "a load failing its checksum is no hit")
	require.Zero(t, s.Stats().Pinned)
}

// A chunk a load read back from disk is no host memory hit (the disk tier
// counts it): a load of one chunk from each counts one.
func TestPoolHitsLeaveOutChunksReadBackFromDisk(t *testing.T) {
	s, e, _, _ := onDiskOnly(t) // a on disk only, c in host memory
	_, err := e.PrepareLoad([]messages.Key{"a", "c"})
	require.NoError(t, err)
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5), chunk("c", 6)}, nil))
	require.Equal(t, 1.0, testutil.ToFloat64(s.metrics.PoolHits), "c only")
}

package store

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
)

// A victim the disk will not take (its writer behind, or the disk closed)
// is not copied out of the pool at all: the copy would be thrown away on
// the engine's decision path.
func TestAVictimTheDiskWillNotTakeIsNotCopied(t *testing.T) {
	const chunk = 1 << 20
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 30}, nil)
	require.NoError(t, err)
	s := New(heapArena(make([]byte, 4*chunk)), 0, d, metrics.NewPool(nil))
	e := s.Engine("e", mustLayout(t, 1, messages.Region{BlockStride: 64, BlockBytes: 64}), nil)
	victims := []hostpool.Victim{{Key: "k", Extents: []hostpool.Extent{{Off: 0, Len: chunk}}}}
	d.Close()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 20 {
		e.spill(victims)
	}
	runtime.ReadMemStats(&after)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(chunk), "no %d-byte copy per victim", chunk)
	require.EqualValues(t, 20, d.Stats().Dropped, "each counted dropped")
}

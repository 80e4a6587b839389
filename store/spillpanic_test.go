package store

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
)

// panicsToDisk is a disk key mapping that panics: a bug below the spill
// of a decision's victims.
type panicsToDisk struct{}

func (panicsToDisk) ToDisk(messages.Key) (messages.Key, bool) {
	panic("disk key mapping failure injected")
}

// A decision whose victims' spill to disk panics frees the room it was
// given before the panic goes on: the decision never learns of that room,
// so no job would ever complete it, and its key would stay pending for
// good, held back from every request that offers it. Here a one-chunk pool
// holds a, b's decision evicts it and the spill panics; b is then neither
// pending nor present, and a second decision for b gets its room.
func TestASpillThatPanicsFreesTheDecisionsRoom(t *testing.T) {
	const bb = 64
	l := mustLayout(t, 1, messages.Region{BlockStride: bb, BlockBytes: bb})
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	s := New(heapArena(make([]byte, bb)), bb, d, metrics.NewPool(nil))
	e := s.Engine("e", l, &memDevice{mem: make([]byte, 4*bb)})
	storeChunks(t, e, chunk("a", 1))
	require.True(t, s.Ready("a"))

	s.UseDiskKeys(panicsToDisk{})
	require.PanicsWithValue(t, "disk key mapping failure injected", func() {
		_, _ = e.PrepareStore([]messages.Key{"b"}, []int64{bb})
	})
	st := s.Stats()
	require.Zero(t, st.Pending, "b's room stayed pending after its decision's spill panicked")
	require.Zero(t, st.Used)

	s.UseDiskKeys(nil)
	storeChunks(t, e, chunk("b", 2))
	require.True(t, s.Ready("b"))
}

package store

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A load that ends in the pool and then drops a chunk that failed its
// check (here corrupt in host memory) returns a panic in that drop (here
// the journal's) as an error, with the load's own: out of Copy, the
// transfer side would abort the load's pool side a second time, ending by
// key what may be another job's by then (a key freed and reserved again,
// another load's pins). The load's pins are gone, nothing is pending, and
// the chunk is dropped (its journal entry is what panicked).
func TestAPanicDroppingAfterTheLoadEndedIsAnError(t *testing.T) {
	s, e, _, _ := fixture(t, 2, 16<<10, 0)
	storeChunks(t, e, chunk("a", 1, 2))
	loc, err := s.pool.Locate([]messages.Key{"a"})
	require.NoError(t, err)
	s.arena.Bytes()[loc.Ext[0].Off] ^= 1
	s.SetJournal(func(bool, []messages.Key, string) { panic("journal failure injected") })

	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	require.NotPanics(t, func() {
		err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 10, 11)}, nil)
	})
	require.ErrorIs(t, err, ErrCorrupt)
	require.ErrorContains(t, err, "journal failure injected")
	st := s.Stats()
	require.Zero(t, st.Pinned, "the load's pin")
	require.Zero(t, st.Pending)
	require.Zero(t, st.Used, "the corrupt chunk dropped")
}

// The same at the size check: a chunk in host memory of another size than
// the loading engine's group, dropped after the load ended.
func TestAPanicDroppingAMisfitAfterTheLoadEndedIsAnError(t *testing.T) {
	s, e, dev, _ := fixture(t, 1, 8*testBlockBytes, testBlockBytes)
	wide := s.Engine("f", mustLayout(t, 2, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes}), dev)
	storeChunks(t, wide, chunk("a", 1, 2)) // twice e's chunk
	s.SetJournal(func(bool, []messages.Key, string) { panic("journal failure injected") })

	_, err := e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	require.NotPanics(t, func() {
		err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil)
	})
	require.ErrorIs(t, err, ErrCorrupt)
	require.ErrorContains(t, err, "journal failure injected")
	st := s.Stats()
	require.Zero(t, st.Pinned, "the load's pin")
	require.Zero(t, st.Pending)
}

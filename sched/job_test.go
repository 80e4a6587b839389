package sched

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "A store job copies each accepted chunk's non-null blocks (all
// regions) from device memory into its pool slot": Keys are the chunks' keys
// in order ("stored" lists them), each pending in the pool; the copy plan is
// the store's (store/plan_test.go).
func TestStoreJobKeys(t *testing.T) {
	h := newHarness(t, layout(t, 4, 2, full(4)), 64, added(16)) // full: a chunk with a null first block is stored
	h.step(hashes(0, 4), blocks(0, 0, 0, 5, 6, 7), tokens(16, 16))
	e := h.advance()
	require.NotNil(t, e.Job)
	require.Equal(t, []messages.Key{key(0, 0, 2), key(0, 1, 2)}, e.Job.Keys())
	require.Equal(t, rid, e.Job.Request)
	require.Equal(t, JobID(1), e.Job.ID)
	for _, c := range e.Job.Chunks {
		st, size := h.pool.Lookup(c.Key)
		require.Equal(t, hostpool.Pending, st)
		require.Equal(t, h.lay.Groups[c.Group].ChunkBytes, size, "the pool holds the chunk's bytes")
	}
}

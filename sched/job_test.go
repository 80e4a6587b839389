package sched

import (
	"slices"
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

// A store job's block ids alias the request's own (no copy per job), so
// nothing may write over ids a job holds: a preempted request that resumes
// gets its fresh ids in a new array, and the job still in flight copies the
// blocks it was built for.
func TestAJobsBlockIdsOutliveAResumeWithFreshIds(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(16))
	h.step(hashes(0, 4), blocks(0, 0, 1, 2, 3, 4), tokens(8, 16)) // two chunks ready of four known
	e := h.advance()
	require.NotNil(t, e.Job)
	require.Equal(t, [][]messages.BlockID{{1}, {2}}, jobBlocks(e.Job))

	h.step(preempted())
	h.advance()
	h.step(resumed(), blocks(0, 0, 7, 8, 9, 10)) // the engine gave the request other blocks
	require.Equal(t, [][]messages.BlockID{{1}, {2}}, jobBlocks(e.Job), "the job copies the blocks it was built for")
}

func jobBlocks(j *StoreJob) [][]messages.BlockID {
	out := make([][]messages.BlockID, len(j.Chunks))
	for i, c := range j.Chunks {
		out[i] = slices.Clone(c.Blocks)
	}
	return out
}

package sched

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// A request whose ready chunks need more than an empty pool holds is
// stored in parts (kvactors' choice, docs/PROTOCOL.md "A decision larger
// than the pool"): a decision offers at most what the pool holds, so each
// part fits, and each job's completion decides again. All or nothing, it
// stored none of them, ever, and at finish held the engine's blocks
// through every retry before giving all of them up (found by review).
func TestReadyChunksPastThePoolAreStoredInParts(t *testing.T) {
	lay := layout(t, 4, 1, full(4), full(4)) // two groups, one 4-token chunk per block
	h := newHarness(t, lay, 8, added(48))
	h.step(hashes(0, 12), blocks(0, 0, seq(1, 12)...), blocks(1, 0, seq(13, 12)...), tokens(48, 48))
	// 24 chunks of 2 groups, 8 a decision (the pool), the groups alike.
	require.Equal(t, twelveChunksInThreeParts, storedInParts(t, h, 8))
	require.Equal(t, []messages.ChunkIndex{12, 12}, h.cursors())
	for _, n := range h.stored {
		require.Equal(t, 1, n, "each chunk stored once")
	}
	require.Len(t, h.stored, 24)

	// Finished at once, with the pool too small: stored in parts, then
	// released; nothing given up.
	h2 := newHarness(t, lay, 8, added(48))
	h2.step(hashes(0, 12), blocks(0, 0, seq(1, 12)...), blocks(1, 0, seq(13, 12)...), tokens(48, 48), finished(48, 48))
	var given int
	released := false
	for e := h2.advance(); ; e = h2.advance() {
		given += e.GivenUp
		released = released || len(e.Releases) > 0
		if e.Job == nil {
			break
		}
		d := h2.done(e.Job.ID, true)
		given += d.GivenUp
		released = released || len(d.Releases) > 0
	}
	require.True(t, released)
	require.Zero(t, given)
	require.Len(t, h2.stored, 24)
}

// A pool of one chunk takes a request's chunks one at a time: a decision
// never offers nothing for want of the bound.
func TestAPoolOfOneChunkTakesAChunkAtATime(t *testing.T) {
	lay := layout(t, 4, 1, full(4))
	h := newHarness(t, lay, 1, added(8))
	h.step(hashes(0, 2), blocks(0, 0, 1, 2), tokens(8, 8))
	e := h.advance()
	require.Equal(t, []string{"0/0"}, jobChunks(e.Job))
	h.done(e.Job.ID, true)
	require.Equal(t, []string{"0/1"}, jobChunks(h.advance().Job))
}

// A capped decision whose part is already in the pool makes no job, and
// no completion will call for the next: it asks for one at once
// (Effects.More), and a finishing request is not released meanwhile.
func TestACappedDecisionWithNoJobAsksForMore(t *testing.T) {
	lay := layout(t, 4, 1, full(4))
	h := newHarness(t, lay, 8, added(48))
	h.step(hashes(0, 12), blocks(0, 0, seq(1, 12)...), tokens(48, 48), finished(48, 48))
	var first []messages.Key
	for c := range 8 {
		first = append(first, Key(0, hash(c), 0))
	}
	_, err := h.pool.PrepareStore(first, nil) // another request stored the first part: the whole pool
	require.NoError(t, err)
	h.pool.CompleteStore(first, make([]uint32, len(first)))

	e := h.advance()
	require.Nil(t, e.Job)
	require.True(t, e.More, "the rest is still to decide")
	require.Empty(t, e.Releases, "not released with chunks undecided")
	require.Equal(t, 8, e.Deduped)
	e = h.advance()
	require.Equal(t, []string{"0/8", "0/9", "0/10", "0/11"}, jobChunks(e.Job))
	require.False(t, e.More)
}

// A pool's chunk cap bounds a decision as its pages do: a request whose
// ready chunks are more than the pool may hold, within its bytes, is
// stored in parts of at most the cap (capToRoom asks HoldsEmpty, which
// counts the cap), not refused as "pool full" at every retry.
func TestReadyChunksPastTheChunkCapAreStoredInParts(t *testing.T) {
	lay := layout(t, 4, 1, full(4), full(4))
	h := newHarness(t, lay, 64, added(48)) // the bytes of 64 chunks
	h.pool.SetMaxChunks(8)
	h.step(hashes(0, 12), blocks(0, 0, seq(1, 12)...), blocks(1, 0, seq(13, 12)...), tokens(48, 48))
	require.Equal(t, twelveChunksInThreeParts, storedInParts(t, h, 8))
	require.Equal(t, []messages.ChunkIndex{12, 12}, h.cursors())
	require.Len(t, h.stored, 24)
}

// twelveChunksInThreeParts: 12 chunks of each of 2 groups stored 8 a job.
var twelveChunksInThreeParts = [][]string{
	{"0/0", "0/1", "0/2", "0/3", "1/0", "1/1", "1/2", "1/3"},
	{"0/4", "0/5", "0/6", "0/7", "1/4", "1/5", "1/6", "1/7"},
	{"0/8", "0/9", "0/10", "0/11", "1/8", "1/9", "1/10", "1/11"},
}

// storedInParts decides and completes h's jobs until none comes, as the
// actor decides again after each completion, and returns each job's
// chunks; no decision may be a retry, and the pool never holds more than
// most chunks.
func storedInParts(t *testing.T, h *harness, most int) (parts [][]string) {
	t.Helper()
	for e := h.advance(); e.Job != nil; e = h.advance() {
		require.Nil(t, e.Retry)
		parts = append(parts, jobChunks(e.Job))
		h.done(e.Job.ID, true)
		require.LessOrEqual(t, h.pool.Len(), most)
	}
	return parts
}

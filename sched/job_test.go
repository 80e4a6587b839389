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

// recordingPreparer is a pool that keeps a copy of what it answered each
// decision: the keys it gave room, their room and their entries.
type recordingPreparer struct {
	*hostpool.Pool
	keys  []messages.Key
	rooms [][]hostpool.Extent
	slots []int32
}

func (p *recordingPreparer) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if err := p.Pool.PrepareStoreInto(out, keys, sizes); err != nil {
		return err
	}
	p.keys, p.rooms, p.slots = slices.Clone(out.Keys), nil, slices.Clone(out.Slots)
	for i := range out.Keys {
		p.rooms = append(p.rooms, slices.Clone(out.Chunk(i)))
	}
	return nil
}

// A job's chunk copies into the room its decision reserved for its own
// key, and completes by that key's entry: with a chunk before it already
// in the pool (deduplicated), the i'th chunk offered is not the i'th given
// room, and the room and entry must be looked up by the latter.
func TestAJobsChunksTakeTheirOwnKeysRoom(t *testing.T) {
	lay := oneGroup4(t)
	pool := &recordingPreparer{Pool: poolOf(lay, 8)}
	k0 := key(0, 0, 1)
	_, err := pool.PrepareStore([]messages.Key{k0}, nil) // chunk 0 is in the pool already
	require.NoError(t, err)
	pool.CompleteStore([]messages.Key{k0}, sumsIf([]messages.Key{k0}, true))

	r := NewRequest(lay, added(12))
	for _, ev := range ev(hashes(0, 3), blocks(0, 0, 1, 2, 3), tokens(12, 12)) {
		require.NoError(t, r.Step(ev))
	}
	e := r.Advance(pool)
	require.Equal(t, 1, e.Deduped)
	require.Equal(t, []string{"0/1", "0/2"}, jobChunks(e.Job))
	require.Equal(t, pool.keys, e.Job.Keys())
	require.Len(t, pool.slots, 2, "the pool reports entries")
	require.NotEqual(t, pool.slots[0], pool.slots[1])
	for i, c := range e.Job.Chunks {
		require.NotEmpty(t, c.Room, "chunk %d has room", c.Index)
		require.Equal(t, pool.rooms[i], c.Room, "chunk %d's room", c.Index)
		require.Equal(t, pool.slots[i], c.Slot, "chunk %d's entry", c.Index)
	}
}

// ContinueJobs numbers a request's jobs after an earlier request's last
// (a stale cancel for that one's must not name this one's), and never
// back.
func TestContinueJobsNumbersAfterTheLast(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(8))
	h.req.ContinueJobs(41)
	h.req.ContinueJobs(5)
	require.Equal(t, JobID(41), h.req.LastJob())
	h.step(hashes(0, 2), blocks(0, 0, 1, 2), tokens(4, 8))
	e := h.advance()
	require.Equal(t, JobID(42), e.Job.ID)
	require.Equal(t, JobID(42), h.req.LastJob())
}

// A done job holds on to no other job in flight: the caller may keep it
// (a trace, the transfer side's map) while the request's later jobs are
// done and dropped.
func TestADoneJobLinksToNoOther(t *testing.T) {
	h := newHarness(t, oneGroup4(t), 64, added(8))
	h.step(hashes(0, 2), blocks(0, 0, 1, 2), tokens(4, 8))
	first := h.advance().Job
	h.step(tokens(8, 8))
	second := h.advance().Job
	require.NotNil(t, first)
	require.NotNil(t, second)
	require.Same(t, second, first.next, "in flight, oldest first")
	h.done(first.ID, true)
	require.Nil(t, first.next)
	require.Equal(t, []JobID{second.ID}, h.req.Snapshot().InFlight)
}

package sched

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "EngineSpec": GPU block b is, in each region, the bytes
// [offset + b*block_stride, offset + b*block_stride + block_bytes); "A chunk's
// host copy is its blocks in order, each block its regions in order."
// PROTOCOL.md "block id 0": a null block is not copied.
func TestRanges(t *testing.T) {
	const bb = 64
	region := func(seg int, off, stride int64) messages.Region {
		return messages.Region{Segment: seg, Offset: off, BlockStride: stride, BlockBytes: bb}
	}
	lay := func(bpc int, regions ...messages.Region) *Layout {
		s := spec(4, bpc, full(4))
		s.Segments = []messages.Segment{{Shm: "a"}, {Shm: "b"}}
		s.Groups[0].Regions = regions
		return mustLayout(t, s)
	}
	chunk := func(slot hostpool.Slot, ids ...messages.BlockID) JobChunk {
		return JobChunk{Group: 0, Slot: slot, Blocks: ids}
	}
	rg := func(seg int, segOff, poolOff, n int64) backend.Range {
		return backend.Range{Segment: seg, SegOffset: segOff, PoolOff: poolOff, Len: n}
	}
	for _, tc := range []struct {
		name      string
		lay       *Layout
		chunks    []JobChunk
		slotBytes int64
		want      []backend.Range
	}{
		{
			name: "consecutive blocks of one tensor merge into one copy",
			lay:  lay(3, region(0, 1000, bb)), chunks: []JobChunk{chunk(2, 5, 6, 7)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, 1000+5*bb, 2*3*bb, 3*bb)},
		},
		{
			name: "pool offset is slot times slot bytes",
			lay:  lay(1, region(0, 0, bb)), chunks: []JobChunk{chunk(3, 9)}, slotBytes: 1000,
			want: []backend.Range{rg(0, 9*bb, 3000, bb)},
		},
		{
			name: "blocks with gaps do not merge",
			lay:  lay(2, region(0, 0, bb)), chunks: []JobChunk{chunk(0, 5, 7)}, slotBytes: 2 * bb,
			want: []backend.Range{rg(0, 5*bb, 0, bb), rg(0, 7*bb, bb, bb)},
		},
		{
			name: "interleaved regions merge across regions and blocks",
			// Region 1 sits right after region 0 in each 2*bb block stride, as
			// the host copy lays block b region 0 then region 1.
			lay:    lay(2, region(0, 0, 2*bb), region(0, bb, 2*bb)),
			chunks: []JobChunk{chunk(1, 4, 5)}, slotBytes: 4 * bb,
			want: []backend.Range{rg(0, 4*2*bb, 4*bb, 4*bb)},
		},
		{
			name: "separate tensors per layer give one copy per block and region",
			lay:  lay(2, region(0, 0, bb), region(1, 0, bb)), chunks: []JobChunk{chunk(0, 4, 5)}, slotBytes: 4 * bb,
			want: []backend.Range{rg(0, 4*bb, 0, bb), rg(1, 4*bb, bb, bb), rg(0, 5*bb, 2*bb, bb), rg(1, 5*bb, 3*bb, bb)},
		},
		{
			name: "null blocks are skipped but keep their place in the slot",
			lay:  lay(3, region(0, 0, bb)), chunks: []JobChunk{chunk(1, 0, 5, 6)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, 5*bb, 3*bb+bb, 2*bb)},
		},
		{
			name: "a null block between two blocks splits the copy",
			lay:  lay(3, region(0, 0, bb)), chunks: []JobChunk{chunk(0, 5, 0, 7)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, 5*bb, 0, bb), rg(0, 7*bb, 2*bb, bb)},
		},
		{
			name: "adjacent slots with consecutive blocks merge across chunks",
			lay:  lay(2, region(0, 0, bb)), chunks: []JobChunk{chunk(0, 1, 2), chunk(1, 3, 4)}, slotBytes: 2 * bb,
			want: []backend.Range{rg(0, bb, 0, 4*bb)},
		},
		{
			name: "slots larger than the chunk do not merge across chunks",
			lay:  lay(2, region(0, 0, bb)), chunks: []JobChunk{chunk(0, 1, 2), chunk(1, 3, 4)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, bb, 0, 2*bb), rg(0, 3*bb, 3*bb, 2*bb)},
		},
		{
			name: "different segments never merge",
			// Offsets as in the interleaved case, but region 1 is in segment 1.
			lay:    lay(1, region(0, 0, 2*bb), region(1, bb, 2*bb)),
			chunks: []JobChunk{chunk(0, 1)}, slotBytes: 2 * bb,
			want: []backend.Range{rg(0, 2*bb, 0, bb), rg(1, 3*bb, bb, bb)},
		},
		{name: "no chunks", lay: lay(1, region(0, 0, bb)), slotBytes: bb},
		{name: "only null blocks", lay: lay(2, region(0, 0, bb)), chunks: []JobChunk{chunk(0, 0, 0)}, slotBytes: 2 * bb},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Ranges(tc.lay, tc.chunks, tc.slotBytes, nil)
			require.Equal(t, tc.want, got)
			// dst is appended to, so a caller can reuse its buffer.
			prefix := []backend.Range{rg(1, 1, 1, 1)}
			require.Equal(t, append(prefix, tc.want...), Ranges(tc.lay, tc.chunks, tc.slotBytes, prefix[:1:1]))
		})
	}
}

// PROTOCOL.md "A chunk's host copy is its blocks in order" and "P.E.load ...
// id 0 = not needed, skipped": a chunk stored with a null first block and
// loaded with a different null pattern finds each block where it was stored.
func TestStoredAndLoadedChunksLineUp(t *testing.T) {
	l := layout(t, 4, 3, swa(4, 8))
	slot := hostpool.Slot(2)
	slotBytes := l.MaxChunkBytes()
	store := Ranges(l, []JobChunk{{Slot: slot, Blocks: []messages.BlockID{0, 5, 6}}}, slotBytes, nil)
	load := Ranges(l, []JobChunk{{Slot: slot, Blocks: []messages.BlockID{0, 0, 9}}}, slotBytes, nil)
	require.Len(t, load, 1)
	// Block 2 of the chunk: stored from GPU block 6, loaded into GPU block 9.
	want := int64(slot)*slotBytes + 2*testBlockBytes
	require.Equal(t, want, load[0].PoolOff)
	require.Equal(t, store[0].PoolOff+testBlockBytes, load[0].PoolOff)
}

// PROTOCOL.md "A store job copies each accepted chunk's non-null blocks (all
// regions) from device memory into its pool slot": Bytes counts those blocks,
// Keys are the chunks' keys in order ("stored" lists them), Slot is the pool
// slot PrepareStore gave the key.
func TestStoreJobBytesAndKeys(t *testing.T) {
	h := newHarness(t, layout(t, 4, 2, swa(4, 8)), 64, added(16))
	h.step(hashes(0, 4), blocks(0, 0, 0, 5, 6, 7), tokens(16, 16))
	e := h.advance()
	require.NotNil(t, e.Job)
	require.Equal(t, int64(3*testBlockBytes), e.Job.Bytes)
	require.Equal(t, []messages.Key{key(0, 0, 2), key(0, 1, 2)}, e.Job.Keys())
	require.Equal(t, rid, e.Job.Request)
	require.Equal(t, JobID(1), e.Job.ID)
	for i, c := range e.Job.Chunks {
		st, slot := h.pool.Lookup(c.Key)
		require.Equal(t, hostpool.Pending, st)
		require.Equal(t, slot, c.Slot, "chunk %d is copied into its pool slot", i)
	}
}

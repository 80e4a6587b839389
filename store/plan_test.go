package store

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

const testBlockBytes = 64

// mustLayout is a one-group layout of bpc blocks per chunk over two segments.
func mustLayout(t *testing.T, bpc int, regions ...messages.Region) *sched.Layout {
	t.Helper()
	l, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: bpc, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "a"}, {Shm: "b"}},
		Groups:   []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 4, Regions: regions}}})
	require.NoError(t, err)
	return l
}

// slotted is a chunk in a fixed-size slot: one extent at slot*slotBytes, the
// single-size pool's case (the table predates size classes).
type slotted struct {
	slot int64
	ids  []messages.BlockID
}

func ranges(l *sched.Layout, chunks []slotted, slotBytes int64, dst []backend.Range) []backend.Range {
	for _, c := range chunks {
		jc := sched.JobChunk{Blocks: c.ids}
		dst = appendRanges(l, &jc, []hostpool.Extent{{Off: c.slot * slotBytes, Len: l.Groups[0].ChunkBytes}}, dst)
	}
	return dst
}

// PROTOCOL.md "EngineSpec": GPU block b is, in each region, the bytes
// [offset + b*block_stride, offset + b*block_stride + block_bytes); "A chunk's
// host copy is its blocks in order, each block its regions in order."
// PROTOCOL.md "block id 0": a null block is not copied.
func TestRanges(t *testing.T) {
	const bb = 64
	region := func(seg int, off, stride int64) messages.Region {
		return messages.Region{Segment: seg, Offset: off, BlockStride: stride, BlockBytes: bb}
	}
	lay := func(bpc int, regions ...messages.Region) *sched.Layout {
		return mustLayout(t, bpc, regions...)
	}
	chunk := func(slot int64, ids ...messages.BlockID) slotted {
		return slotted{slot: slot, ids: ids}
	}
	rg := func(seg int, segOff, poolOff, n int64) backend.Range {
		return backend.Range{Segment: seg, SegOffset: segOff, PoolOff: poolOff, Len: n}
	}
	for _, tc := range []struct {
		name      string
		lay       *sched.Layout
		chunks    []slotted
		slotBytes int64
		want      []backend.Range
	}{
		{
			name: "consecutive blocks of one tensor merge into one copy",
			lay:  lay(3, region(0, 1000, bb)), chunks: []slotted{chunk(2, 5, 6, 7)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, 1000+5*bb, 2*3*bb, 3*bb)},
		},
		{
			name: "pool offset is slot times slot bytes",
			lay:  lay(1, region(0, 0, bb)), chunks: []slotted{chunk(3, 9)}, slotBytes: 1000,
			want: []backend.Range{rg(0, 9*bb, 3000, bb)},
		},
		{
			name: "blocks with gaps do not merge",
			lay:  lay(2, region(0, 0, bb)), chunks: []slotted{chunk(0, 5, 7)}, slotBytes: 2 * bb,
			want: []backend.Range{rg(0, 5*bb, 0, bb), rg(0, 7*bb, bb, bb)},
		},
		{
			name: "interleaved regions merge across regions and blocks",
			// Region 1 sits right after region 0 in each 2*bb block stride, as
			// the host copy lays block b region 0 then region 1.
			lay:    lay(2, region(0, 0, 2*bb), region(0, bb, 2*bb)),
			chunks: []slotted{chunk(1, 4, 5)}, slotBytes: 4 * bb,
			want: []backend.Range{rg(0, 4*2*bb, 4*bb, 4*bb)},
		},
		{
			name: "separate tensors per layer give one copy per block and region",
			lay:  lay(2, region(0, 0, bb), region(1, 0, bb)), chunks: []slotted{chunk(0, 4, 5)}, slotBytes: 4 * bb,
			want: []backend.Range{rg(0, 4*bb, 0, bb), rg(1, 4*bb, bb, bb), rg(0, 5*bb, 2*bb, bb), rg(1, 5*bb, 3*bb, bb)},
		},
		{
			name: "null blocks are skipped but keep their place in the slot",
			lay:  lay(3, region(0, 0, bb)), chunks: []slotted{chunk(1, 0, 5, 6)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, 5*bb, 3*bb+bb, 2*bb)},
		},
		{
			name: "a null block between two blocks splits the copy",
			lay:  lay(3, region(0, 0, bb)), chunks: []slotted{chunk(0, 5, 0, 7)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, 5*bb, 0, bb), rg(0, 7*bb, 2*bb, bb)},
		},
		{
			name: "adjacent slots with consecutive blocks merge across chunks",
			lay:  lay(2, region(0, 0, bb)), chunks: []slotted{chunk(0, 1, 2), chunk(1, 3, 4)}, slotBytes: 2 * bb,
			want: []backend.Range{rg(0, bb, 0, 4*bb)},
		},
		{
			name: "slots larger than the chunk do not merge across chunks",
			lay:  lay(2, region(0, 0, bb)), chunks: []slotted{chunk(0, 1, 2), chunk(1, 3, 4)}, slotBytes: 3 * bb,
			want: []backend.Range{rg(0, bb, 0, 2*bb), rg(0, 3*bb, 3*bb, 2*bb)},
		},
		{
			name: "different segments never merge",
			// Offsets as in the interleaved case, but region 1 is in segment 1.
			lay:    lay(1, region(0, 0, 2*bb), region(1, bb, 2*bb)),
			chunks: []slotted{chunk(0, 1)}, slotBytes: 2 * bb,
			want: []backend.Range{rg(0, 2*bb, 0, bb), rg(1, 3*bb, bb, bb)},
		},
		{name: "no chunks", lay: lay(1, region(0, 0, bb)), slotBytes: bb},
		{name: "only null blocks", lay: lay(2, region(0, 0, bb)), chunks: []slotted{chunk(0, 0, 0)}, slotBytes: 2 * bb},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ranges(tc.lay, tc.chunks, tc.slotBytes, nil)
			require.Equal(t, tc.want, got)
			// dst is appended to, so a caller can reuse its buffer.
			prefix := []backend.Range{rg(1, 1, 1, 1)}
			require.Equal(t, append(prefix, tc.want...), ranges(tc.lay, tc.chunks, tc.slotBytes, prefix[:1:1]))
		})
	}
}

// PROTOCOL.md "A chunk's host copy is its blocks in order" and "P.E.load ...
// id 0 = not needed, skipped": a chunk stored with a null first block and
// loaded with a different null pattern finds each block where it was stored.
func TestStoredAndLoadedChunksLineUp(t *testing.T) {
	l := mustLayout(t, 3, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	slot := int64(2)
	slotBytes := l.MaxChunkBytes()
	store := ranges(l, []slotted{{slot: slot, ids: []messages.BlockID{0, 5, 6}}}, slotBytes, nil)
	load := ranges(l, []slotted{{slot: slot, ids: []messages.BlockID{0, 0, 9}}}, slotBytes, nil)
	require.Len(t, load, 1)
	// Block 2 of the chunk: stored from GPU block 6, loaded into GPU block 9.
	want := int64(slot)*slotBytes + 2*testBlockBytes
	require.Equal(t, want, load[0].PoolOff)
	require.Equal(t, store[0].PoolOff+testBlockBytes, load[0].PoolOff)
}

// A chunk cut into pieces by the pool: a region crossing a piece boundary
// is split there, each part lands at its piece's offset, and parts adjacent
// in both memories still merge.
func TestRangesAcrossPieces(t *testing.T) {
	const bb = 64
	l := mustLayout(t, 3, messages.Region{Segment: 1, Offset: 100, BlockStride: bb, BlockBytes: bb})
	jc := sched.JobChunk{Blocks: []messages.BlockID{4, 5, 6}} // 192 contiguous device bytes
	ext := []hostpool.Extent{{Off: 1000, Len: 100}, {Off: 1100, Len: 50}, {Off: 5000, Len: 42}}
	got := appendRanges(l, &jc, ext, nil)
	require.Equal(t, []backend.Range{
		{Segment: 1, SegOffset: 100 + 4*bb, PoolOff: 1000, Len: 150}, // pieces 0 and 1 are adjacent: merged
		{Segment: 1, SegOffset: 100 + 4*bb + 150, PoolOff: 5000, Len: 42},
	}, got)
	jc.Blocks = []messages.BlockID{0, 5, 0} // only logical bytes [64, 128): across the first boundary
	require.Equal(t, []backend.Range{
		{Segment: 1, SegOffset: 100 + 5*bb, PoolOff: 1064, Len: 64},
	}, appendRanges(l, &jc, ext, nil))
	require.Equal(t, int64(bb), CopyBytes(l, []sched.JobChunk{jc}))
}

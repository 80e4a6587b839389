package store

import (
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/sched"
)

// appendRanges turns one chunk into copy ranges. Inside a chunk, block i sits
// at i*BlockBytes, each block its regions in order, so a chunk stored with
// some null blocks and loaded into others lines up; a null block's bytes are
// neither copied nor read. The chunk's bytes lie in ext, in order (the pool
// may cut a chunk into pieces); a region that crosses a piece boundary is
// split there. Ranges adjacent in both device and pool memory are merged, so
// consecutive blocks of one tensor become one DMA-sized copy.
func appendRanges(l *sched.Layout, c *sched.JobChunk, ext []hostpool.Extent, dst []backend.Range) []backend.Range {
	regions := l.Groups[c.Group].Regions
	var off int64            // logical offset in the chunk
	ei, start := 0, int64(0) // extent ext[ei] holds logical [start, start+ext[ei].Len)
	for _, b := range c.Blocks {
		for _, r := range regions {
			if b == 0 {
				off += r.BlockBytes
				continue
			}
			seg, segOff, n := r.Segment, r.Offset+int64(b)*r.BlockStride, r.BlockBytes
			for n > 0 {
				for off >= start+ext[ei].Len {
					start += ext[ei].Len
					ei++
				}
				take := min(n, start+ext[ei].Len-off)
				dst = appendMerged(dst, backend.Range{Segment: seg, SegOffset: segOff,
					PoolOff: ext[ei].Off + off - start, Len: take})
				off, segOff, n = off+take, segOff+take, n-take
			}
		}
	}
	return dst
}

func appendMerged(dst []backend.Range, r backend.Range) []backend.Range {
	if n := len(dst); n > 0 {
		p := &dst[n-1]
		if p.Segment == r.Segment && p.SegOffset+p.Len == r.SegOffset && p.PoolOff+p.Len == r.PoolOff {
			p.Len += r.Len
			return dst
		}
	}
	return append(dst, r)
}

// CopyBytes is the bytes a copy of the chunks moves: their non-null blocks.
func CopyBytes(l *sched.Layout, chunks []sched.JobChunk) int64 {
	var n int64
	for i := range chunks {
		for _, b := range chunks[i].Blocks {
			if b != 0 {
				n += l.Groups[chunks[i].Group].BlockBytes
			}
		}
	}
	return n
}

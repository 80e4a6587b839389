package store

import (
	"math"

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
	return appendWindow(l, c, ext, 0, math.MaxInt64, dst)
}

// appendWindow is appendRanges for the chunk's logical bytes [lo, hi) only
// (a large chunk is copied a window at a time).
func appendWindow(l *sched.Layout, c *sched.JobChunk, ext []hostpool.Extent, lo, hi int64,
	dst []backend.Range) []backend.Range {
	regions := l.Groups[c.Group].Regions
	var off int64            // logical offset in the chunk
	ei, start := 0, int64(0) // extent ext[ei] holds logical [start, start+ext[ei].Len)
	for _, b := range c.Blocks {
		for _, r := range regions {
			rlo, rhi := max(off, lo), min(off+r.BlockBytes, hi)
			if b == 0 || rlo >= rhi {
				off += r.BlockBytes
				continue
			}
			seg, segOff, n := r.Segment, r.Offset+int64(b)*r.BlockStride+rlo-off, rhi-rlo
			at := rlo
			for n > 0 {
				for at >= start+ext[ei].Len {
					start += ext[ei].Len
					ei++
				}
				take := min(n, start+ext[ei].Len-at)
				dst = appendMerged(dst, backend.Range{Segment: seg, SegOffset: segOff,
					PoolOff: ext[ei].Off + at - start, Len: take})
				at, segOff, n = at+take, segOff+take, n-take
			}
			off += r.BlockBytes
		}
		if off >= hi {
			break
		}
	}
	return dst
}

// clearNulls zeroes the pool bytes of c's null blocks within its logical
// bytes [lo, hi), which lie in ext in order. A store copies only non-null
// blocks, and its room may still hold an evicted chunk's bytes, another
// engine's KV perhaps: left there, they would be checksummed and handed out
// under this chunk's key, to a load into those places, to the disk tier and
// to a node fetching the chunk.
func clearNulls(l *sched.Layout, c *sched.JobChunk, ext []hostpool.Extent, arena []byte, lo, hi int64) {
	per := l.Groups[c.Group].BlockBytes // block i is logical [i*per, (i+1)*per)
	for i, b := range c.Blocks {
		if b != 0 {
			continue
		}
		zlo, zhi := max(int64(i)*per, lo), min(int64(i+1)*per, hi)
		var at int64 // logical offset of x
		for _, x := range ext {
			if a, z := max(zlo, at), min(zhi, at+x.Len); a < z {
				clear(arena[x.Off+a-at : x.Off+z-at])
			}
			if at += x.Len; at >= zhi {
				break
			}
		}
	}
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

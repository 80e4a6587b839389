package sched

import (
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// JobID numbers the store jobs of one request, from 1.
type JobID uint64

// JobChunk is one chunk of a store or load job: its key, its pool slot and its
// bpc GPU block ids in order, 0 for a null (skipped) block. In the slot, block
// i of the chunk sits at i*BlockBytes, each block its regions in order, so a
// chunk stored with some null blocks and loaded into others lines up; a null
// block's bytes are neither copied nor read.
type JobChunk struct {
	Group  int
	Index  messages.ChunkIndex
	Key    messages.Key
	Slot   hostpool.Slot
	Blocks []messages.BlockID
}

// StoreJob copies chunks of one request from device to pool. Chunks are
// group-major, in chunk order within a group.
type StoreJob struct {
	ID      JobID
	Request string
	Chunks  []JobChunk
	Bytes   int64
}

// Keys lists the job's keys, in chunk order.
func (j *StoreJob) Keys() []messages.Key {
	keys := make([]messages.Key, len(j.Chunks))
	for i := range j.Chunks {
		keys[i] = j.Chunks[i].Key
	}
	return keys
}

// Ranges turns chunks into copy ranges for a pool whose slots are slotBytes
// long. Ranges adjacent in both device and pool memory are merged, so
// consecutive blocks of one tensor become one DMA-sized copy.
func Ranges(l *Layout, chunks []JobChunk, slotBytes int64, dst []backend.Range) []backend.Range {
	for _, c := range chunks {
		regions := l.Groups[c.Group].Regions
		off := int64(c.Slot) * slotBytes
		for _, b := range c.Blocks {
			for _, r := range regions {
				if b != 0 {
					dst = appendMerged(dst, backend.Range{Segment: r.Segment,
						SegOffset: r.Offset + int64(b)*r.BlockStride, PoolOff: off, Len: r.BlockBytes})
				}
				off += r.BlockBytes
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

// CopyBytes is the bytes a copy of the chunk moves: its non-null blocks.
func (l *Layout) CopyBytes(c *JobChunk) int64 {
	var n int64
	for _, b := range c.Blocks {
		if b != 0 {
			n += l.Groups[c.Group].BlockBytes
		}
	}
	return n
}

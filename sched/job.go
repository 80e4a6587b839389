package sched

import (
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// JobID numbers the store jobs of one request, from 1.
type JobID uint64

// JobChunk is one chunk of a store or load job: its key and its bpc GPU block
// ids in order, 0 for a null (skipped) block. Where the chunk lives in the
// pool, and how its blocks map to copy ranges, is the store's business
// (store.appendRanges).
type JobChunk struct {
	Group  int
	Index  messages.ChunkIndex
	Key    messages.Key
	Blocks []messages.BlockID
	// Room is where a store job's chunk goes in the arena, as its decision
	// reserved it (hostpool.Prepared.Room), and Slot its pool entry
	// (Prepared.Slots); Room nil: the copy locates the key.
	Room []hostpool.Extent
	Slot int32
}

// StoreJob copies chunks of one request from device to pool. Chunks are
// group-major, in chunk order within a group.
type StoreJob struct {
	ID      JobID
	Request string
	Chunks  []JobChunk
	// next is the request's next job in flight: a list, not a slice, so a
	// live request holds no backing array for them.
	next *StoreJob
}

// Keys lists the job's keys, in chunk order.
func (j *StoreJob) Keys() []messages.Key {
	keys := make([]messages.Key, len(j.Chunks))
	for i := range j.Chunks {
		keys[i] = j.Chunks[i].Key
	}
	return keys
}

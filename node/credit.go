package node

import (
	"sync/atomic"
	"unsafe"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/messages"
)

// credit is one batch's bytes in the intake budget while its engine actor
// has not handled it. It is returned once: by the actor, or when the
// engine's route ends, whichever comes first.
type credit struct {
	in       *ingester
	engine   string
	bucket   uint8 // the engine's share it was admitted to: returned there
	size     int64
	returned atomic.Bool
}

// lend counts a batch of size bytes (already admitted to bucket, engineID's)
// as held by engineID's actor pid until the credit is returned; nil when pid
// is no longer the engine's route (its credits were returned already: the
// caller releases).
func (in *ingester) lend(engineID string, bucket uint8, pid *actor.PID, size int64) *credit {
	c := &credit{in: in, engine: engineID, bucket: bucket, size: size}
	in.mu.Lock()
	if cur := in.engines[engineID]; cur == nil || !cur.Equal(pid) {
		in.mu.Unlock()
		return nil
	}
	set := in.credits[engineID]
	if set == nil {
		set = map[*credit]struct{}{}
		in.credits[engineID] = set
	}
	set[c] = struct{}{}
	in.mu.Unlock()
	return c
}

// Signal is the engine actor's notice that it handled the batch
// (engine.Batch.Done): the batch's bytes go back to the budget, once.
func (c *credit) Signal() {
	if !c.returned.CompareAndSwap(false, true) {
		return
	}
	c.in.mu.Lock()
	delete(c.in.credits[c.engine], c)
	c.in.mu.Unlock()
	c.in.release(c.bucket, c.size)
}

func (in *ingester) returnAll(held map[*credit]struct{}) {
	for c := range held {
		if c.returned.CompareAndSwap(false, true) {
			in.release(c.bucket, c.size)
		}
	}
}

// buckets is how many shares the intake budget has: an engine's messages
// count in its id's (bucketOf) as well as in the total.
const buckets = 64

// bucketBytes is one bucket's pending bytes, on a cache line of its own:
// take and the workers of different engines touch different lines.
type bucketBytes struct {
	n atomic.Int64
	_ [56]byte
}

// share is what one bucket may hold: the budget less a quarter, so engines
// of other buckets always have that quarter, whatever one engine (or the
// few sharing its bucket) publishes.
func (in *ingester) share() int64 { return in.budget - in.budget/4 }

func (in *ingester) admit(bucket uint8, size int64) bool { return in.admitWithin(bucket, size, -1) }

// admitMore counts extra bytes more for a message of size bytes already
// admitted (a batch's decoded size past its wire size), within the budget;
// or past it when that message is all intake holds, so a batch larger than
// the budget decoded still goes, alone, as a large copy job does. Its
// bucket's share is passed likewise only by a message that is all the
// bucket holds: a batch larger than the share decoded still goes, within
// the budget, while its engine has nothing else in intake.
func (in *ingester) admitMore(bucket uint8, extra, size int64) bool {
	return in.admitWithin(bucket, extra, size)
}

// admitWithin counts size bytes more in bucket and in the total if they fit
// bucket's share and the budget, or if the bucket, for its share, and
// intake, for the budget, hold at most alone bytes now (-1: never past
// either). The bucket is counted first, by one Add (undone when refused:
// meanwhile another message of the bucket may be refused too, at its full
// share anyway).
func (in *ingester) admitWithin(bucket uint8, size, alone int64) bool {
	b := &in.buckets[bucket].n
	if held := b.Add(size); held > in.share() && held-size > alone {
		b.Add(-size)
		return false
	}
	for {
		cur := in.pending.Load()
		if cur+size > in.budget && cur > alone {
			b.Add(-size)
			return false
		}
		if in.pending.CompareAndSwap(cur, cur+size) {
			for p := in.peak.Load(); cur+size > p && !in.peak.CompareAndSwap(p, cur+size); p = in.peak.Load() {
			}
			return true
		}
	}
}

// release gives size bytes back to bucket and the total: every release
// names the bucket its bytes were admitted to (inbound.bucket,
// credit.bucket), or the bucket would stay short of them for good.
func (in *ingester) release(bucket uint8, size int64) {
	in.buckets[bucket].n.Add(-size)
	in.pending.Add(-size)
}

// fullestBucket is the most bytes one bucket holds now (read at scrape
// time).
func (in *ingester) fullestBucket() int64 {
	var most int64
	for i := range in.buckets {
		most = max(most, in.buckets[i].n.Load())
	}
	return most
}

// heldBytes is what a decoded batch holds in memory, near enough: its
// events (the slice's whole capacity), each hash's string header and
// bytes, each block id.
func heldBytes(b *messages.EventBatch) int64 {
	n := int64(cap(b.Events)) * int64(unsafe.Sizeof(messages.Event{}))
	for i := range b.Events {
		e := &b.Events[i]
		n += int64(len(e.IDs)) * int64(unsafe.Sizeof(messages.BlockID(0)))
		for _, h := range e.Hashes {
			n += int64(unsafe.Sizeof(h)) + int64(len(h))
		}
	}
	return n
}

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
	bucket   uint8 // where it counts (noBucket: calm): returned there
	size     int64
	returned atomic.Bool
}

// lend counts a batch of size bytes (already admitted, counting in bucket)
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
// past the calm part count in its id's (bucketOf) as well as in the total.
const buckets = 64

// noBucket is where a message admitted calm counts (inbound.bucket,
// credit.bucket): in the total only, no bucket.
const noBucket uint8 = 0xFF

// bucketBytes is one bucket's pending bytes, on a cache line of its own:
// take and the workers of different engines touch different lines.
type bucketBytes struct {
	n atomic.Int64
	_ [56]byte
}

// calm is what intake may hold with no message counted in a bucket: a
// message that fits within it with all intake holds is admitted calm, by
// the one CompareAndSwap on the total that admits it anyway, so a calm
// intake pays no bucket's atomic add, at admission or at release.
func (in *ingester) calm() int64 { return in.budget / 4 }

// share is what one bucket may hold counted: half the budget. Calm bytes are
// a quarter at most, all engines' together (see admitMore), so an engine
// (or the few sharing its bucket) holds at most three quarters, calm and
// counted, and engines of other buckets always have the last quarter.
func (in *ingester) share() int64 { return in.budget / 2 }

// admit counts a message of size bytes of an engine of bucket: calm when
// intake holds at most calm bytes with it, otherwise in bucket, within its
// share (or past it while the bucket holds nothing else: at the smallest
// budget, twice the server's max_payload, a largest message is past the
// share), and in the total, within the budget. It returns where the
// message counts (noBucket: calm), which its release names; false: refused.
func (in *ingester) admit(bucket uint8, size int64) (uint8, bool) {
	if in.admitCalm(size) {
		return noBucket, true
	}
	return bucket, in.count(bucket, size, size, 0, -1)
}

// admitMore counts extra bytes more for a message of size bytes already
// admitted to counted (a batch's decoded size past its wire size), home
// being its engine's bucket, and returns where the message counts from now
// on, its size and extra together.
//
// A counted message's extra counts in its bucket within the share and in
// the total within the budget; or past the budget when that message is all
// intake holds, so a batch larger than the budget decoded still goes,
// alone, as a large copy job does; its bucket's share is passed likewise
// only by a message that is all the bucket holds: a batch larger than the
// share decoded still goes, within the budget, while its engine has
// nothing else in intake.
//
// A calm message's extra is calm too while intake holds at most calm bytes
// with it. Otherwise the message moves into home: its size and extra count
// there (past the share only when the bucket holds nothing else), the extra
// in the total (past the budget only when the message is all intake holds),
// and it counts there from then on; refused, it stays calm, as it was.
//
// The calm bytes (those of messages counting in noBucket) never exceed
// calm: they are part of the total, and each calm admission raises the
// total, by one CompareAndSwap, to at most calm with them; a move only takes
// bytes out of them, a release out of both. With a bucket's counted bytes
// within its share (but for the one message past it alone in the bucket),
// the engines of one bucket hold at most calm plus share, three quarters of
// the budget.
func (in *ingester) admitMore(counted, home uint8, extra, size int64) (uint8, bool) {
	if counted != noBucket {
		return counted, in.count(counted, extra, extra, size, size)
	}
	if in.admitCalm(extra) {
		return noBucket, true
	}
	return home, in.count(home, size+extra, extra, 0, size)
}

// admitCalm counts size bytes in the total if it holds at most calm bytes
// with them.
func (in *ingester) admitCalm(size int64) bool {
	for {
		cur := in.pending.Load()
		if cur+size > in.calm() {
			return false
		}
		if in.pending.CompareAndSwap(cur, cur+size) {
			in.peaked(cur + size)
			return true
		}
	}
}

// count counts inBucket bytes more in bucket and total bytes more in the
// total if they fit bucket's share and the budget, or if the bucket held at
// most bucketAlone bytes before, for its share, and intake holds at most
// alone bytes now, for the budget (-1: never past either). The bucket is
// counted first, by one Add (undone when refused: meanwhile another message
// of the bucket may be refused too, at its full share anyway).
func (in *ingester) count(bucket uint8, inBucket, total, bucketAlone, alone int64) bool {
	b := &in.buckets[bucket].n
	if held := b.Add(inBucket); held > in.share() && held-inBucket > bucketAlone {
		b.Add(-inBucket)
		return false
	}
	for {
		cur := in.pending.Load()
		if cur+total > in.budget && cur > alone {
			b.Add(-inBucket)
			return false
		}
		if in.pending.CompareAndSwap(cur, cur+total) {
			in.peaked(cur + total)
			return true
		}
	}
}

// peaked records held as the most pending ever if it is.
func (in *ingester) peaked(held int64) {
	for p := in.peak.Load(); held > p && !in.peak.CompareAndSwap(p, held); p = in.peak.Load() {
	}
}

// release gives size bytes back to bucket (none: noBucket) and the total:
// every release names where its bytes count (inbound.bucket,
// credit.bucket), or a bucket would stay short of them for good.
func (in *ingester) release(bucket uint8, size int64) {
	if bucket != noBucket {
		in.buckets[bucket].n.Add(-size)
	}
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

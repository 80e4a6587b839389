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
	size     int64
	returned atomic.Bool
}

// lend counts a batch of size bytes (already admitted) as held by engineID's
// actor pid until the credit is returned; nil when pid is no longer the
// engine's route (its credits were returned already: the caller releases).
func (in *ingester) lend(engineID string, pid *actor.PID, size int64) *credit {
	c := &credit{in: in, engine: engineID, size: size}
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
	c.in.release(c.size)
}

func (in *ingester) returnAll(held map[*credit]struct{}) {
	for c := range held {
		if c.returned.CompareAndSwap(false, true) {
			in.release(c.size)
		}
	}
}

func (in *ingester) admit(size int64) bool { return in.admitWithin(size, -1) }

// admitMore counts extra bytes more for a message of size bytes already
// admitted (a batch's decoded size past its wire size), within the budget;
// or past it when that message is all intake holds, so a batch larger than
// the budget decoded still goes, alone, as a large copy job does.
func (in *ingester) admitMore(extra, size int64) bool { return in.admitWithin(extra, size) }

// admitWithin counts size bytes more if they fit the budget, or if intake
// holds at most alone bytes now (-1: never past the budget).
func (in *ingester) admitWithin(size, alone int64) bool {
	for {
		cur := in.pending.Load()
		if cur+size > in.budget && cur > alone {
			return false
		}
		if in.pending.CompareAndSwap(cur, cur+size) {
			for p := in.peak.Load(); cur+size > p && !in.peak.CompareAndSwap(p, cur+size); p = in.peak.Load() {
			}
			return true
		}
	}
}

func (in *ingester) release(size int64) {
	in.pending.Add(-size)
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

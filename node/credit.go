package node

import (
	"sync/atomic"

	"github.com/asynkron/protoactor-go/actor"
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

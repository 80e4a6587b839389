package engine

import (
	"context"
	"slices"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors/request"
)

// A request id can outlive its epoch: an engine that resyncs re-announces
// its live requests, with the same block ids, in the new epoch, while the
// old epoch's request actor, reset, still waits for a copy reading those
// blocks. The engine frees a request's blocks on a release of its current
// epoch, so the new request's releases must wait for every older request
// of its id to be over (none of its copies runs once it reported Done).
// old keeps those older requests, oldest first; a request spawned while
// its id has some is held (request.Hold), and let go (request.Unhold) once
// none older is left. A release the engine actor makes itself for an
// unknown request (finished) waits the same way (deferredRelease).

// deferredRelease is a release of an unknown request waiting for the
// older requests of its id.
type deferredRelease struct {
	ctx           context.Context
	epoch, reason string
}

// retiredFromLive: e is no longer live (resetAll) but may still be copying; a later
// request of its id waits for it. One already releasing for good has no
// copy left.
func (a *Actor) retiredFromLive(e *entry) {
	if e.releasing.Load() {
		return
	}
	if a.old == nil {
		a.old = map[string][]*entry{}
	}
	a.old[e.id] = append(a.old[e.id], e)
}

// holdIfOlder holds e, just spawned, while older requests of its id remain.
func (a *Actor) holdIfOlder(c actor.Context, e *entry) {
	if len(a.old[e.id]) > 0 {
		e.held = true
		c.Send(e.pid, &request.Hold{})
	}
}

// deferIfOlder keeps a release the engine actor makes for an unknown
// request back while older requests of its id remain; false: publish it.
func (a *Actor) deferIfOlder(ctx context.Context, id, epoch, reason string) bool {
	if len(a.old[id]) == 0 {
		return false
	}
	if a.deferred == nil {
		a.deferred = map[string][]deferredRelease{}
	}
	a.deferred[id] = append(a.deferred[id], deferredRelease{ctx: ctx, epoch: epoch, reason: reason})
	a.perEpoch[epoch]++ // the epoch's release count is kept until it goes out
	return true
}

// leftLineage: e has left byPID (Done, or its failure's release). If it
// was an older request of its id, the oldest one left, or with none left
// the live one and the deferred releases, may release now.
func (a *Actor) leftLineage(c actor.Context, e *entry) {
	olds, was := a.dropOld(e)
	switch {
	case !was:
	case len(olds) > 0:
		a.unhold(c, olds[0])
	default:
		a.publishDeferred(e.id) // before the live request's: oldest epoch first
		if cur := a.live[e.id]; cur != nil {
			a.unhold(c, cur)
		}
	}
}

// leaveLineage takes e out of its id's lineage without letting anyone go
// (a hand-off while the actor stops: it releases e itself).
func (a *Actor) leaveLineage(e *entry) {
	e.held = false
	a.dropOld(e)
}

// dropOld removes e from its id's older requests and returns those left;
// was: e was one of them.
func (a *Actor) dropOld(e *entry) (left []*entry, was bool) {
	olds := a.old[e.id]
	i := slices.Index(olds, e)
	if i < 0 {
		return olds, false
	}
	if olds = slices.Delete(olds, i, i+1); len(olds) > 0 {
		a.old[e.id] = olds
	} else {
		delete(a.old, e.id)
	}
	return olds, true
}

// unhold lets e release; a failed e has no actor to tell, and its own
// release goes out now if its copies are over (else on Drained).
func (a *Actor) unhold(c actor.Context, e *entry) {
	if !e.held {
		return
	}
	e.held = false
	switch {
	case !e.failed:
		c.Send(e.pid, &request.Unhold{})
	case e.drained:
		a.releaseFailed(c, e)
	}
}

// publishAllDeferred publishes every deferred release: the actor is
// stopping, and no one would be left to.
func (a *Actor) publishAllDeferred() {
	for id := range a.deferred {
		a.publishDeferred(id)
	}
}

// publishDeferred publishes id's deferred releases.
func (a *Actor) publishDeferred(id string) {
	rels, ok := a.deferred[id]
	if !ok {
		return
	}
	delete(a.deferred, id)
	for _, r := range rels {
		a.deps.Metrics.Release(r.reason).Inc()
		a.deps.Releases.Publish(r.ctx, r.epoch, id, r.reason, nil)
		a.epochLeft(r.epoch)
	}
}

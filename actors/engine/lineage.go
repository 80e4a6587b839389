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
	if len(a.old[e.id]) > 0 || a.awaitingPredecessors {
		e.held = true
		c.Send(e.pid, &request.Hold{})
	}
}

// deferIfOlder keeps a release the engine actor makes for an unknown
// request back while older requests of its id remain; false: publish it.
func (a *Actor) deferIfOlder(ctx context.Context, id, epoch, reason string) bool {
	if len(a.old[id]) == 0 && !a.awaitingPredecessors {
		return false
	}
	if a.deferred == nil {
		a.deferred = map[string][]deferredRelease{}
	}
	a.deferred[id] = append(a.deferred[id], deferredRelease{ctx: ctx, epoch: epoch, reason: reason})
	a.perEpoch[epoch]++ // the epoch's release count is kept until it goes out
	if o := a.deps.Request.Owed; o != nil {
		o.Add(1) // owed until it goes out: a shutdown sealed meanwhile counts it undelivered
	}
	return true
}

// leftLineage: e has left byPID (Done, or its failure's release). If it
// was an older request of its id, the oldest one left, or with none left
// the live one and the deferred releases, may release now.
func (a *Actor) leftLineage(c actor.Context, e *entry) {
	if _, was := a.dropOld(e); was && !a.awaitingPredecessors {
		a.letGo(c, e.id)
	}
}

// letGo lets the next of id's lineage release, nothing older being left
// (no predecessor either): its oldest request no longer live, or with none
// the deferred releases and then the live request.
func (a *Actor) letGo(c actor.Context, id string) {
	if olds := a.old[id]; len(olds) > 0 {
		a.unhold(c, olds[0])
		return
	}
	a.publishDeferred(id) // before the live request's: oldest epoch first
	if cur := a.live[id]; cur != nil {
		a.unhold(c, cur)
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
	var then func()
	if o := a.deps.Request.Owed; o != nil {
		then = func() { o.Add(-1) } // with the publish, before a shutdown's Seal can look
	}
	for _, r := range rels {
		if a.deps.Releases.Publish(r.ctx, r.epoch, id, r.reason, then) {
			a.deps.Metrics.Release(r.reason).Inc() // sealed: not sent, still owed, not counted
		}
		a.epochLeft(r.epoch)
	}
}

// Predecessors. The lineage above holds within one actor. A register that
// replaces an engine's actor (a new spec, a silence of lease/2, a failed
// actor's engine registering again) makes a new one while the old one
// still ends: its reset requests release only once their copies are over,
// and those copies read GPU blocks the engine may re-announce to the new
// actor in its next epoch. So the new actor holds every request and defers
// every release it makes itself until each predecessor has closed (no copy
// of it runs: Deps.Closed), usually milliseconds, at most until the
// predecessor's last copy is stopped. It also keeps the release counts of
// ended epochs until then: a predecessor may still number releases of
// them (Releases is the engine's, shared).

// predecessorsEnded: every one of Deps.Predecessors has closed.
type predecessorsEnded struct{}

// awaitPredecessors starts waiting for the predecessors still ending (the
// actor's first turn, before any request is spawned).
func (a *Actor) awaitPredecessors(c actor.Context) {
	var open []<-chan struct{}
	for _, ch := range a.deps.Predecessors {
		select {
		case <-ch:
		default:
			open = append(open, ch)
		}
	}
	if len(open) == 0 {
		return
	}
	a.awaitingPredecessors = true
	root, self := c.ActorSystem().Root, c.Self()
	go func() {
		for _, ch := range open {
			<-ch // closes once its actor stopped, after its last copy (or the node's end)
		}
		root.Send(self, predecessorsEnded{})
	}()
}

// predecessorsEnded lets go of what waited for the predecessors: in each
// request id's lineage, its oldest part (as leftLineage would, the last
// older request gone), and the epochs' counts it kept.
func (a *Actor) predecessorsEnded(c actor.Context) {
	if !a.awaitingPredecessors {
		return
	}
	a.awaitingPredecessors = false
	ids := map[string]struct{}{}
	for id := range a.old {
		ids[id] = struct{}{}
	}
	for id := range a.deferred {
		ids[id] = struct{}{}
	}
	for id, e := range a.live {
		if e.held {
			ids[id] = struct{}{}
		}
	}
	for id := range ids {
		a.letGo(c, id)
	}
	for _, epoch := range a.forgetLater {
		a.forgetIfIdle(epoch)
	}
	a.forgetLater = nil
	a.maybeStop(c)
}

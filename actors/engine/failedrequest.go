package engine

import (
	"context"
	"sync/atomic"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/messages"
)

// terminated handles a request actor that stopped. One that reported Done
// owes nothing; one that stopped unreleased failed (actors.StopOnPanic).
func (a *Actor) terminated(c actor.Context, m *actor.Terminated) {
	a.spawner.Forget(m.Who) // an idle actor that stopped is not reused
	e, ok := a.byPID[m.Who.Id]
	if !ok {
		return // stopped after Done: nothing owed
	}
	if e.releasing.Load() {
		a.gone(c, e, m.Who)
		if cur := a.live[e.id]; cur == e {
			delete(a.live, e.id)
		}
		// Its release went out, and no Done will come: counted for the
		// retire when released with its reason (as done counts: one that
		// released finished is not), whether it stopped with the engine
		// actor or failed after the publish.
		if e.retired && e.releasing.Reason() == a.retireReason {
			a.retireCount++
		}
		if a.stopping {
			// Stopped with the engine actor once released for good: its
			// Done may wait in the mailbox behind this (system messages
			// first), or never be handled (the actor stopped). Not a
			// failure.
			return
		}
		// It failed after its final release went out: a second, aborted,
		// release could free a later request that reuses the id. (The flag
		// goes up just before the publish, a buffered write that does not
		// fail on its input.)
		a.deps.Metrics.RequestFailure.Inc()
		a.deps.Log.Error("request actor failed after its release", "engine", a.deps.Engine, "request", e.id)
		return
	}
	// The request actor failed (supervision stopped it). The engine is owed a
	// release so it can reuse the blocks, but only once no copy of the
	// request reads them (PROTOCOL.md, finished and preempted): the
	// transfer actor cancels its queued copies (pool side aborted) and
	// answers Drained once none runs. Until then the request keeps its
	// place (its id is not free, a retire waits for it) and its events are
	// rejected. The actor's own state is not trusted for this: the panic
	// may have left it half changed. Its stores are abandoned.
	// Its owed count stays up (a watched request actor leaves it) until
	// that release (releaser).
	if a.stopping {
		// Stopped with the engine actor (its last resort, giveUp), not
		// failed: released aborted once its copies end, with no engine
		// actor left to take a Drained.
		e.failed = true
		a.handOff(c, e)
		return
	}
	a.deps.Metrics.RequestFailure.Inc()
	if a.deps.Request.Transfer == nil {
		// No copy can run: released at once.
		a.deps.Log.Error("request actor failed; released as aborted", "engine", a.deps.Engine, "request", e.id)
		e.failed, e.drained = true, true
		if !e.held {
			a.releaseFailed(c, e)
		}
		a.resyncAfterFailure(c, e)
		return
	}
	a.deps.Log.Error("request actor failed; releasing it as aborted once its copies end", "engine", a.deps.Engine,
		"request", e.id)
	e.failed = true
	c.Send(a.deps.Request.Transfer, &transfer.Drain{Owner: m.Who, ReplyTo: c.Self()})
	a.resyncAfterFailure(c, e)
}

// resyncAfterFailure resyncs the epoch of a request whose actor failed. The
// node forgets the request once its one release (aborted) is out, while
// the engine may still run it: a later preemption or end of it would be
// rejected as unknown and never released, and one release may answer
// fewer events than the engine counts owed (a preemption's and an end's).
// The heartbeat's released count (what was sent) shows nothing amiss
// either way. A new epoch re-announces what the engine still holds, and
// its releases settle it. An ended epoch's request needs none: the engine
// has moved on.
func (a *Actor) resyncAfterFailure(c actor.Context, e *entry) {
	if a.ending() || e.epoch != a.seq.Epoch() {
		return
	}
	a.decided(c, context.Background(), a.seq.Lost(a.deps.Now(), messages.ResyncGap))
}

// drained: no copy of a failed request is queued or running any more
// (terminated); its release goes out.
func (a *Actor) drained(c actor.Context, m *transfer.Drained) {
	if a.stopping {
		return // every failed request was handed off (handOffDraining)
	}
	e, ok := a.byPID[m.Owner.Id]
	if !ok || !e.failed {
		a.deps.Metrics.Unexpected.Inc()
		return
	}
	e.drained = true
	if !e.held { // held: an older request of its id may still copy (unhold releases it)
		a.releaseFailed(c, e)
	}
}

// handOffDraining hands off the failed requests still waiting for Drained
// when the actor stops (its last resort, giveUp): that Drained would find
// no one, and no release at all would come.
// A panic in one hand-off is recovered (guard): in Stopping it would keep
// protoactor from stopping the children and finishing the stop.
func (a *Actor) handOffDraining(c actor.Context) {
	for _, e := range a.byPID {
		if e.failed {
			a.guard(c, "a failed request's hand-off", func() { a.handOff(c, e) })
		}
	}
}

// handOff has the transfer side release a failed request, aborted, once
// none of its copies is queued or running (transfer.Queue.DrainThen, or
// transfer.Drain's Then without a queue: the engine actor is stopping and
// will not be there to take a Drained). Closed waits for that release
// (ends). The release may run on this goroutine, a copy worker's or the
// transfer actor's, and touches only what is safe there: the engine's
// Releases (locked; request actors publish from their own goroutines too),
// a counter, the owed count. The request's epoch count is not forgotten:
// its release may still come.
func (a *Actor) handOff(c actor.Context, e *entry) {
	delete(a.byPID, e.pid.Id)
	if cur := a.live[e.id]; cur == e {
		delete(a.live, e.id)
	}
	// Its release is the transfer side's now: an older request of its id
	// ending during the stop must not let it go again (unhold), and the
	// last-resort stop waits for no hold (PROTOCOL.md's known limits).
	a.leaveLineage(e)
	release := a.releaser(e)
	if a.deps.Request.Transfer == nil {
		release() // no copy can run
		return
	}
	en := a.ends
	en.add()
	// The end is given back even if the release panics (runThen recovers
	// it, counted as a Then failure): that release is lost, but Closed
	// must close all the same, or the node never unmaps the device, never
	// returns the segments and never gives up the claim.
	then := func() {
		defer en.done()
		release()
	}
	if q := a.deps.Request.Queue; q != nil {
		// Straight to the queue: a Drain message queued behind the transfer
		// actor's stop (node teardown) would be dropped, and Closed would
		// never close. It does not panic (owners compared nil-safely, each
		// abort and then recovered): then runs, once.
		q.DrainThen(e.pid, then)
		return
	}
	c.Send(a.deps.Request.Transfer, &transfer.Drain{Owner: e.pid, Then: then})
}

// releaser returns a failed request's one release, aborted; it may run on
// another goroutine (handOff).
func (a *Actor) releaser(e *entry) func() {
	rel, count, epoch, id := a.deps.Releases, a.deps.Metrics.Release(messages.ReasonAborted), e.epoch, e.id
	var then func()
	if o := a.deps.Request.Owed; o != nil {
		then = func() { o.Add(-1) }
	}
	return func() {
		if rel.PublishHandedOff(context.Background(), epoch, id, messages.ReasonAborted, then) {
			count.Inc()
		}
	}
}

// releaseFailed publishes a failed request's one release, aborted, and
// forgets it.
func (a *Actor) releaseFailed(c actor.Context, e *entry) {
	a.releaser(e)() // before gone: the last of an ended epoch forgets its count
	a.gone(c, e, e.pid)
	if cur := a.live[e.id]; cur == e {
		delete(a.live, e.id)
	}
}

// ends closes Closed once its count is down to zero: one for the actor,
// until it has stopped, and one per release handOff left to the transfer
// side (the node unmaps the device once Closed is closed: never under a
// copy).
type ends struct {
	left   atomic.Int64
	closed chan struct{}
}

func newEnds(closed chan struct{}) *ends {
	e := &ends{closed: closed}
	e.left.Store(1)
	return e
}

func (e *ends) add() { e.left.Add(1) }

func (e *ends) done() {
	if e.left.Add(-1) == 0 && e.closed != nil {
		close(e.closed)
	}
}

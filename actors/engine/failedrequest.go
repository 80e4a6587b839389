package engine

import (
	"context"

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
		a.gone(e, m.Who)
		if cur := a.live[e.id]; cur == e {
			delete(a.live, e.id)
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
	a.deps.Metrics.RequestFailure.Inc()
	if o := a.deps.Request.Owed; o != nil {
		o.Add(1) // the stopped actor settled it; the release is still owed
	}
	if a.stopping || a.deps.Request.Transfer == nil {
		// No one would take the Drained (or no copy can run): released at once.
		a.deps.Log.Error("request actor failed; released as aborted", "engine", a.deps.Engine, "request", e.id)
		a.releaseFailed(e)
		return
	}
	a.deps.Log.Error("request actor failed; releasing it as aborted once its copies end", "engine", a.deps.Engine,
		"request", e.id)
	e.failed = true
	c.Send(a.deps.Request.Transfer, &transfer.Drain{Owner: m.Who, ReplyTo: c.Self()})
}

// drained: no copy of a failed request is queued or running any more
// (terminated); its release goes out.
func (a *Actor) drained(m *transfer.Drained) {
	e, ok := a.byPID[m.Owner.Id]
	if !ok || !e.failed {
		a.deps.Metrics.Unexpected.Inc()
		return
	}
	a.releaseFailed(e)
}

// releaseDraining releases, at once, the failed requests still waiting for
// Drained when the actor stops (it failed again while ending): their
// Drained would find no one, and no release at all would come.
func (a *Actor) releaseDraining() {
	for _, e := range a.byPID {
		if e.failed {
			a.deps.Log.Error("engine actor stopping; releasing a failed request before its copies end",
				"engine", a.deps.Engine, "request", e.id)
			a.releaseFailed(e)
		}
	}
}

// releaseFailed publishes a failed request's one release, aborted, and
// forgets it.
func (a *Actor) releaseFailed(e *entry) {
	a.gone(e, e.pid)
	if cur := a.live[e.id]; cur == e {
		delete(a.live, e.id)
	}
	var then func()
	if o := a.deps.Request.Owed; o != nil {
		then = func() { o.Add(-1) }
	}
	a.deps.Metrics.Release(messages.ReasonAborted).Inc()
	a.deps.Releases.Publish(context.Background(), e.epoch, e.id, messages.ReasonAborted, then)
}

package engine

import (
	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/messages"
)

// gone removes a request from byPID; an ended epoch with no request left
// forgets its release count.
func (a *Actor) gone(c actor.Context, e *entry, pid *actor.PID) {
	delete(a.byPID, pid.Id)
	a.epochLeft(e.epoch)
	a.leftLineage(c, e)
}

// epochLeft: one thing that may still publish a release of epoch (a
// request in byPID, a deferred release) is gone; the last forgets the
// epoch's release count once it ended.
func (a *Actor) epochLeft(epoch string) {
	if a.perEpoch[epoch]--; a.perEpoch[epoch] <= 0 {
		delete(a.perEpoch, epoch)
		a.forgetIfIdle(epoch)
	}
}

func (a *Actor) forgetIfIdle(epoch string) {
	if a.awaitingPredecessors {
		a.forgetLater = append(a.forgetLater, epoch) // a predecessor may still number its releases
		return
	}
	if epoch != a.seq.Epoch() && a.perEpoch[epoch] == 0 {
		a.deps.Releases.Forget(epoch)
	}
}

// done: the request was released for good. Its actor goes back to the
// spawner for the next request, or is stopped here, by its parent; either
// way a Terminated for a pid still live means a failure.
func (a *Actor) done(c actor.Context, m *request.Done) {
	if e := a.live[m.Request]; e != nil && e.pid.Equal(m.PID) {
		delete(a.live, m.Request)
	}
	e := a.byPID[m.PID.Id]
	if e != nil {
		a.gone(c, e, m.PID)
		if e.retired && m.Reason == a.retireReason {
			a.retireCount++
		}
	}
	if e != nil && !a.retiring {
		a.spawner.Release(c, m.PID)
	} else {
		c.Stop(m.PID)
	}
	a.maybeStop(c)
}

// retire ends the engine: every live request is reset with the reason
// (engine_gone on unregister and expiry, engine_reset on a new spec or
// shutdown), and the actor stops once all are released.
func (a *Actor) retire(c actor.Context, m *Retire) {
	reason := m.Reason
	if reason == "" {
		reason = messages.ReasonEngineReset
	}
	if !a.retiring {
		a.retiring, a.retireReason, a.retireReply = true, reason, m.Reset
		for _, e := range a.live {
			e.retired = true
		}
		a.resetAll(c, reason)
	} else if reason == a.retireReason && m.Reset != nil {
		a.retireLater = append(a.retireLater, m.Reset) // told the count with the first (Retire)
	} else {
		tell(m.Reset, 0) // a later retire of another reason released nothing with it
	}
	a.maybeStop(c)
}

// resetAll sends every live request a Reset; they release (with reason) once
// their in-flight copies finish and report Done.
func (a *Actor) resetAll(c actor.Context, reason string) {
	for id, e := range a.live {
		delete(a.live, id)
		a.retiredFromLive(e)
		if e.releasing.Load() || e.failed {
			continue // released for good already, or failed: no release of this reason comes
		}
		c.Send(e.pid, &request.Reset{Reason: reason})
	}
}

// countLive keeps the live-engines gauge: one per engine, in from Started
// until Stopped (or Restarting, should one come: endOnFailure never
// restarts), and out once.
func (a *Actor) countLive(live bool) {
	if live == a.counted {
		return
	}
	a.counted = live
	if live {
		a.deps.Metrics.EnginesLive.Inc()
	} else {
		a.deps.Metrics.EnginesLive.Dec()
	}
}

// tell sends n on a buffered count channel (nil: no one asked).
func tell(ch chan<- int, n int) {
	if ch == nil {
		return
	}
	select {
	case ch <- n:
	default:
	}
}

// tellRetire tells the retire that reset the requests its count, and the
// later ones of its reason, once.
func (a *Actor) tellRetire() {
	tell(a.retireReply, a.retireCount)
	for _, ch := range a.retireLater {
		tell(ch, a.retireCount)
	}
	a.retireReply, a.retireLater = nil, nil
}

func (a *Actor) maybeStop(c actor.Context) {
	// Not while it awaits predecessors: its deferred releases would go out
	// as it stops, and Closed close, with a predecessor's copy still running.
	if a.retiring && len(a.byPID) == 0 && !a.awaitingPredecessors {
		// Counted from the Dones, not at the reset: a request that raised
		// its releasing flag after resetAll looked releases finished, not
		// with the retire's reason, and is not counted.
		a.tellRetire()
		c.Stop(c.Self())
	}
}

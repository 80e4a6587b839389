package engine

// Events that need the engine rather than a live request: an added spawns
// the request's actor (or is refused at --max-requests), and a finished,
// preempted or other event for an unknown request is answered or rejected
// as PROTOCOL.md says.

import (
	"context"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/messages"
)

// route handles an event that needs the engine (added for a new request,
// finished or anything else for an unknown one) and returns the live
// request the event is to be forwarded to, or nil.
func (a *Actor) route(c actor.Context, m *Batch, ev *messages.Event) *entry {
	id := ev.Request
	e := a.live[id]
	if e != nil && e.releasing.Load() {
		// Released for good, its Done not handled yet: the engine may
		// already reuse the id (it has the release), so the request is
		// unknown here, as it is once Done is handled (which then finds
		// the id gone or another request's).
		delete(a.live, id)
		e = nil
	}
	if e != nil && e.failed {
		// Its actor failed: the request is over, its release (aborted) waits
		// for its copies (terminated), and no event changes that.
		a.deps.Metrics.Rejected.WithLabelValues(messages.RejectReleased).Inc()
		a.deps.Reject.Reject(messages.RejectReleased, "event rejected", "engine", a.deps.Engine, "request", id,
			"type", ev.Type.String(), "err", "request actor failed; its release waits for its copies")
		return nil
	}
	if e == nil {
		switch ev.Type {
		case messages.EvAdded:
			if a.deps.MaxRequests > 0 && len(a.live) >= a.deps.MaxRequests {
				a.dropReleased()
			}
			if a.deps.MaxRequests > 0 && len(a.live) >= a.deps.MaxRequests {
				a.deps.Metrics.Rejected.WithLabelValues(messages.RejectLimit).Inc()
				a.deps.Reject.Reject(messages.RejectLimit, "added refused: too many live requests", "engine", a.deps.Engine,
					"request", id, "live", len(a.live), "max_requests", a.deps.MaxRequests)
				a.refused.refuse(id, a.seq.Epoch())
				return nil
			}
			a.refused.forget(id)
			a.spawn(c, m.Ctx, ev)
			return nil // the added event is the actor's first state
		case messages.EvFinished, messages.EvPreempted:
			// PROTOCOL.md: finished for an unknown request is answered with
			// released at once (the engine may be waiting for its blocks).
			// So is a preempted of a request whose added was refused for
			// the limit (the engine was not told, and waits for a release
			// per preemption); of any other unknown request it is rejected.
			reason := messages.ReasonFinished
			switch {
			case ev.Type == messages.EvPreempted && !a.refused.preempt(id, a.seq.Epoch()):
				a.rejectUnknown(id, ev)
				return nil
			case ev.Type == messages.EvPreempted:
				reason = messages.ReasonPreempted
			case ev.Aborted:
				reason = messages.ReasonAborted
				a.refused.forget(id)
			default:
				a.refused.forget(id)
			}
			if a.deferIfOlder(m.Ctx, id, a.seq.Epoch(), reason) {
				return nil // an older request of the id may still copy from its blocks
			}
			if a.deps.Releases.Publish(m.Ctx, a.seq.Epoch(), id, reason, nil) {
				a.deps.Metrics.Release(reason).Inc()
			}
			return nil
		case messages.EvResumed:
			a.refused.resume(id, a.seq.Epoch())
			a.rejectUnknown(id, ev) // counted still: the node tracks nothing of it
			return nil
		default:
			a.rejectUnknown(id, ev)
			return nil
		}
	}
	return e
}

// dropReleased forgets every live request whose final release went out,
// its Done not handled yet, as route does for one whose id comes again:
// the engine may have freed its slot and added another at once, and
// --max-requests bounds the requests live for the engine. Only when a
// release was raised since the last sweep, so an added refused at the limit
// costs no scan of the live requests.
func (a *Actor) dropReleased() {
	n := a.raised.Load() // before the scan: a flag raised during it moves n again
	if n == a.swept {
		return
	}
	a.swept = n
	for id, e := range a.live {
		if e.releasing.Load() {
			delete(a.live, id)
		}
	}
}

func (a *Actor) spawn(c actor.Context, ctx context.Context, added *messages.Event) {
	if ctx == nil {
		ctx = context.Background()
	}
	// One Deps per epoch, shared by its requests (it names their epoch and
	// stamps their copies with the session they began in).
	if a.reqDeps == nil || a.reqDeps.Epoch != a.seq.Epoch() {
		d := a.deps.Request
		d.Epoch, d.Releases, d.Session = a.seq.Epoch(), a.deps.Releases, a.epochSession
		d.HearingGen = a.epochHearing // the generation the epoch's first message was taken in
		a.reqDeps = &d
	}
	deps := a.reqDeps
	if deps.Owed != nil {
		deps.Owed.Add(1) // before the actor exists: a shutdown count never misses it
	}
	e := &entry{id: added.Request, epoch: deps.Epoch}
	e.releasing.CountIn(&a.raised)
	pid := a.spawner.SpawnWatched(c, deps, added, ctx, &e.releasing)
	e.pid = pid
	a.live[added.Request] = e
	a.byPID[pid.Id] = e
	a.perEpoch[e.epoch]++
	a.holdIfOlder(c, e)
}

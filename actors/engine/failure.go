package engine

import (
	"fmt"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/messages"
)

// maxFailures bounds the failed turns of an engine actor that is ending:
// past it, the actor stops (giveUp).
const maxFailures = 8

// ending reports whether the engine is ending (a retire, or a failure): no
// new work is taken, no lapse handled.
func (a *Actor) ending() bool { return a.retiring || a.failed }

// failure handles a turn that panicked. The first ends the engine (fail);
// later ones (an unrelated message on state the first left half changed)
// only count, and the end goes on: its requests' copies may still run, and
// only their request actors know when they end. The actor stops (giveUp)
// when fail itself failed, or past maxFailures.
func (a *Actor) failure(c actor.Context) {
	a.failures++
	switch {
	case a.stopping || a.gaveUp:
		// It is stopping already: nothing more can be done here.
	case a.failing || a.failures > maxFailures:
		a.giveUp(c)
	default:
		a.fail(c)
	}
}

// giveUp stops the actor: its state is too broken to end the engine as an
// unregister does. The last resort still keeps PROTOCOL.md's release rule:
// as it stops, each request still unreleased is released aborted once no
// copy of it is queued or running (handOff), and Closed, which lets the
// node unmap the device, is closed only after all those releases.
func (a *Actor) giveUp(c actor.Context) {
	a.gaveUp = true
	c.Stop(c.Self())
	a.failing = false
	a.deps.Log.Error("engine actor failed again while ending its engine; stopping it", "engine", a.deps.Engine,
		"failures", a.failures)
}

// fail ends the engine after one of the actor's turns panicked, as an
// unregister or expiry does (PROTOCOL.md "P.E.unregister"): every request
// is reset and released engine_gone (queued copies cancelled, copies in
// flight finished first), the actor stops once all are released, and the
// node is told (Deps.Failed) so it forgets the engine, unmaps its segments
// and gives up its claim. A restart instead would have dropped the
// requests with no release that waits for their copies, the batch's
// credit and the epoch's seq. Counted once, in kvactors_engine_failures_total.
//
// The node is told first: should anything after it fail too (the retire on
// state the panic left half changed, a log handler, a metric), the engine
// is forgotten all the same, its credit, segments and claim given back.
func (a *Actor) fail(c actor.Context) {
	if a.failed {
		return
	}
	a.failed, a.failing = true, true
	var count chan int
	if !a.retiring {
		count = make(chan int, 1)
	}
	a.report(c, count)
	a.deps.Metrics.Failures.Inc()
	a.deps.Log.Error("engine actor failed; ending the engine as on unregister", "engine", a.deps.Engine,
		"requests", len(a.live), "retiring", a.retiring)
	if count != nil {
		a.retire(c, &Retire{Reason: messages.ReasonEngineGone, Reset: count})
	}
	a.failing = false
}

// report calls Deps.Failed, once: from fail, or, should the actor stop
// after a failure without it (a panic before it in fail), as it stops.
func (a *Actor) report(c actor.Context, count <-chan int) {
	if a.reported {
		return
	}
	a.reported = true
	if a.deps.Failed != nil {
		a.deps.Failed(a.deps.Engine, c.Self(), count)
	}
}

// stopped is the actor's last turn. protoactor has removed it from the
// registry by now: a panic here is resumed, but no turn follows. So each
// step is guarded, and Closed's count (the node waits for it to unmap the
// device and give up the claim) and the loop are released whatever fails
// before them.
func (a *Actor) stopped(c actor.Context) {
	defer a.ends.done() // Closed, unless releases handed off still wait for copies
	defer a.loop.Close()
	if a.failed {
		// the node must forget the engine, whatever stopped fail before it did
		a.guard(c, "report", func() { a.report(c, nil) })
	}
	a.guard(c, "retire count", a.tellRetire)
	a.guard(c, "release counts", a.retainEpochs)
	a.guard(c, "live-engines gauge", func() { a.countLive(false) })
	if t := a.deps.Request.Timers; t != nil {
		a.guard(c, "timers", t.Stop) // its requests, children, have stopped already
	}
}

// guard runs f, a step of the actor's stop, and recovers a panic in it. It
// is logged, and counted once in kvactors_engine_failures_total unless the
// engine failed already. A panic while the actor stops would keep
// protoactor from finishing the stop, or (in Stopped) leave Closed open.
// Only for the stop: a turn's panic otherwise goes to supervision
// (endOnFailure).
func (a *Actor) guard(c actor.Context, what string, f func()) {
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		defer func() { _ = recover() }() // the log handler or the counter may be what panicked
		if !a.failed && !a.stopFailed {
			a.deps.Metrics.Failures.Inc()
		}
		a.stopFailed = true
		a.deps.Log.Error("engine actor failed while stopping; the stop goes on", "engine", a.deps.Engine,
			"step", what, "actor", c.Self().Id, "reason", fmt.Sprint(r))
	}()
	f()
}

// retainEpochs hands the release counts of the epochs this actor still
// kept (its own, and ended ones a predecessor might still have numbered)
// to the engine's Releases, which keeps the most recent of them for a later
// actor that goes on with the epoch (Releases.Retain).
//
// Its own epoch goes last, as the most recent: a successor that goes on
// with it (an engine that keeps its epoch across a re-register) may not
// have released in it yet, and the ended ones retained here must not push
// it out.
func (a *Actor) retainEpochs() {
	own := a.seq.Epoch()
	for _, epoch := range a.forgetLater {
		if epoch != own {
			a.deps.Releases.Retain(epoch)
		}
	}
	for epoch := range a.perEpoch {
		if epoch != own {
			a.deps.Releases.Retain(epoch)
		}
	}
	a.deps.Releases.Retain(own)
}

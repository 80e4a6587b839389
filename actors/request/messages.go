package request

import (
	"time"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Events carries one batch's events for this request, in order.
type Events struct {
	Events  []messages.Event
	Arrived time.Time
	// Applied, when set, is called once the actor is done with Events
	// (applied or ignored): the engine reuses the batch's slice after that.
	Applied actors.Signal
}

// RetryDue is the retry timer firing, or a copy the retry waited for
// ending (retryWake): take the store decision again. gen is the request
// it was armed for (Actor.gen), arm the retry (Actor.arm): a wake-up
// decides only for the retry it was armed with, a timer for whichever
// retry is armed when it falls due (Actor.timer), and only the first of
// them decides.
type RetryDue struct {
	gen, arm uint32
	woken    bool // sent by retryWake, before the backoff ended
}

// Reset ends the request for an engine reset (Reason engine_reset:
// PROTOCOL.md "epoch") or the engine's end (engine_gone: unregister, expiry).
type Reset struct{ Reason string }

// Hold keeps the request's releases back (sched.Request.Hold): an older
// request of its id, of an epoch that ended, may still copy from its
// blocks. The engine actor sends it right after the spawn, and Unhold once
// no older request of the id is left.
type Hold struct{}

// Unhold lets a held request's releases go out.
type Unhold struct{}

// Done tells the engine actor the request was released for good; the engine
// removes it from its table and hands the actor back (Spawner.Release).
type Done struct {
	Request string
	PID     *actor.PID
	// Reason is the reason of its final release ("" if it published
	// none): the engine counts what a retire released (Retire.Reset).
	Reason string
}

// StatusQuery asks for a Status sent to ReplyTo.
type StatusQuery struct{ ReplyTo *actor.PID }

// Status is one request's snapshot for P.E.status.
type Status struct {
	Snapshot sched.RequestSnapshot
}

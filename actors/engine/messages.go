package engine

import (
	"context"
	"time"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Batch is one decoded events batch for this engine.
type Batch struct {
	Batch   messages.EventBatch
	Ctx     context.Context // the engine's trace context from the NATS headers
	Arrived time.Time
	// Done, when set, is called once the actor has handled the batch: it
	// returns the batch's share of the node's intake budget (the credit
	// window between intake and this actor).
	Done actors.Signal
	// Recycle, when set, takes the batch's event slice back for reuse once
	// nothing holds it: at once when no request actor got a part of it,
	// else after the last request actor has applied its part.
	Recycle func([]messages.Event)
	// Session is the node's fence generation when intake took the batch off
	// NATS, with Stamped set (node: ingester.stamp): an epoch the batch
	// begins belongs to it, so a batch that waited through a lapse (in the
	// node's socket or queues) cannot begin a fresh-looking epoch. Unstamped,
	// the generation when the actor handles it.
	Session uint64
	Stamped bool
	// HearingGen is the engine's transfer.Hearing generation when intake
	// took the batch (with Stamped): an epoch it begins, and its requests'
	// copies, belong to that generation, not to one a silence ended after.
	HearingGen uint64
}

// Retire ends the engine: every request is reset and released with Reason
// (engine_gone for unregister and expiry; engine_reset, the default, for a
// new spec or a node shutdown), and the actor stops once they are all
// released. Then Closed is closed. Reset, if set (buffered), receives how
// many requests the retire released with Reason, just before the actor
// stops (a request whose final release was already on its way when the
// retire came releases as it would have, and is not counted). A retire
// that comes after the first, with the first's reason, is told the same
// count at the same time: its requests got the release it asked for (an
// unregister that reaches an engine whose failure began the end, engine_gone,
// is that engine's end, and PROTOCOL.md's released N counts them). With
// another reason it released nothing with its own, and is told 0 at once.
type Retire struct {
	Reason string
	Reset  chan<- int
}

// Heartbeat is P.E.heartbeat; the reply is published on Reply.
type Heartbeat struct {
	Epoch string
	Seq   uint64
	Reply string
	Ctx   context.Context
	// HearingGen, with Stamped, is as Batch's.
	HearingGen uint64
	Stamped    bool
}

// Lost says the node may have lost some of this engine's batches without
// seeing their seq (Reason: reconnect, overflow).
type Lost struct {
	Reason string
	// AliveAt, when set, is when the lost batch came: it was the engine's
	// own (dropped at intake), a sign of life as of then (PROTOCOL.md
	// "Engine liveness"), however late the node tells it. Zero when the loss
	// names no engine.
	AliveAt time.Time
}

// Lapsed says the node's fence generation moved (Deps.Session): a lapse
// began (the engine may have declared the node lost: the actor resets its
// requests and holds a resync order) or ended (it sends the order). It does
// the same whenever it sees Session move.
type Lapsed struct{}

// Touch is a sign of life other than a batch or heartbeat handled (a
// register, or one the node dropped at intake).
type Touch struct {
	// At is when the sign of life came (a dropped message: when intake
	// dropped it, not when the node got round to telling); zero: when the
	// actor handles the Touch.
	At time.Time
}

// Silenced tells the actor that the node, its NATS fine, had heard nothing
// of the engine for For (lease/2 or more) before a message the intake is
// about to hand over (transfer.Hearing): the engine's own link may have
// failed, and the engine may have declared the node lost and reused its
// requests' blocks. The actor resyncs the epoch and resets its requests,
// as on a lapse, before that message.
type Silenced struct{ For time.Duration }

// Tick asks the engine to check its lease (expiry).
type Tick struct{}

// expiryCheck confirms a Tick's expiry after the messages queued before it.
type expiryCheck struct{}

// failed is endOnFailure's word to an actor it resumed after a panic (which
// it logged): end the engine, if the next message has not begun that.
type failed struct{}

// StatusQuery asks for the engine's Status; it is sent on Reply (buffered,
// never blocks the actor).
type StatusQuery struct{ Reply chan<- Status }

// Status is one engine's part of P.E.status.
type Status struct {
	Engine string `json:"engine"`
	Epoch  string `json:"epoch"`
	Seq    uint64 `json:"seq"` // last batch applied in Epoch
	// Resyncing: a gap was seen; nothing more of Epoch is applied.
	Resyncing bool                    `json:"resyncing,omitempty"`
	Requests  []sched.RequestSnapshot `json:"requests"`
	Partial   bool                    `json:"partial,omitempty"` // some request did not answer in time
	// IdleActors are released request actors kept for the engine's next
	// requests (request.Spawner).
	IdleActors int `json:"idle_actors,omitempty"`
	// RequestStateBytes is what the engine's live requests hold of their
	// hashes and block ids (sched.StateBudget), its actors' before a
	// re-register included; RequestStateLimit bounds it.
	RequestStateBytes int64 `json:"request_state_bytes"`
	RequestStateLimit int64 `json:"request_state_limit,omitempty"`
}

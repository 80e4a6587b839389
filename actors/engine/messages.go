package engine

import (
	"context"
	"time"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Batch is one decoded events batch for this engine.
type Batch struct {
	Batch   messages.EventBatch
	Ctx     context.Context // the engine's trace context from the NATS headers
	Arrived time.Time
}

// Retire ends the engine (its spec changed, or the node is shutting down):
// every request is reset as on a new epoch, and the actor stops once they are
// all released. Then Closed is closed.
type Retire struct{}

// StatusQuery asks for the engine's Status; it is sent on Reply (buffered,
// never blocks the actor).
type StatusQuery struct{ Reply chan<- Status }

// Status is one engine's part of P.E.status.
type Status struct {
	Engine   string                  `json:"engine"`
	Epoch    string                  `json:"epoch"`
	Seq      uint64                  `json:"seq"`
	Requests []sched.RequestSnapshot `json:"requests"`
	Partial  bool                    `json:"partial,omitempty"` // some request did not answer in time
}

package transfer

import (
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/sched"
)

// Submit asks for one job's copies. Owner receives exactly one JobDone for it.
type Submit struct {
	Owner     *actor.PID
	Engine    string
	ID        sched.JobID
	Dir       backend.Direction
	Chunks    []sched.JobChunk
	Bytes     int64
	Layout    *sched.Layout
	Device    backend.Device
	SlotBytes int64             // pool slot size: chunk c's bytes start at Slot*SlotBytes
	Span      trace.SpanContext // the job span: the copy span's parent
	Arrived   time.Time         // when the batch that caused it arrived (decision latency)
}

// Cancel removes the owner's queued (not started) jobs; each gets a JobDone
// with Cancelled set. Jobs already copying finish normally.
type Cancel struct {
	Owner *actor.PID
	IDs   []sched.JobID
}

// JobDone reports the end of a job to its owner.
type JobDone struct {
	ID        sched.JobID
	Err       error // nil: every byte landed
	Cancelled bool
	Bytes     int64
	Duration  time.Duration
}

// copyDone goes from a worker back to the transfer actor.
type copyDone struct {
	job *Submit
	err error
	dur time.Duration
}

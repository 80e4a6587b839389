package transfer

import (
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
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
	SlotBytes int64 // pool slot size: chunk c's bytes start at Slot*SlotBytes
	// Pool and Keys: the transfer side completes the pool as soon as the
	// copy ends (or the job is cancelled): a store's pending keys become
	// ready, or are freed on failure; a load's pinned keys are unpinned.
	// Completing here, not in the owner, frees slots at copy speed even when
	// the owner's mailbox is deep in events.
	Pool    *hostpool.Shared
	Keys    []messages.Key
	Span    trace.SpanContext // the job span: the copy span's parent
	Arrived time.Time         // when the batch that caused it arrived (decision latency)
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

// completePool ends the job's pool side: ok says the bytes landed.
func (s *Submit) completePool(ok bool) {
	if s.Pool == nil {
		return
	}
	if s.Dir == backend.HostToDevice {
		s.Pool.CompleteLoad(s.Keys)
		return
	}
	s.Pool.CompleteStore(s.Keys, ok)
}

// copyDone goes from a worker back to the transfer actor.
type copyDone struct {
	job *Submit
	err error
	dur time.Duration
}

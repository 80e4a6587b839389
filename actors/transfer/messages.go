package transfer

import (
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/sched"
)

// Store is the owner of the pool and arena, as the workers use it (package
// store's Engine is the one implementation; decorators may wrap it).
type Store interface {
	// Copy runs the copies of chunks and completes the pool before it
	// returns: a store's pending chunks become ready (or are freed when the
	// copy failed), a load's are unpinned. Completing on the worker, not in
	// the owner, frees room at copy speed even when the owner's mailbox is
	// deep in events.
	//
	// live, when not nil, is asked between device calls whether the copy
	// may go on (and by a store once more before it completes the pool):
	// once it fails, the copy stops, its pool side completes as a failed
	// copy's, and Copy returns live's error wrapped (errors.Is holds). It
	// is cheap (a clock read) and safe from any goroutine.
	Copy(dir backend.Direction, chunks []sched.JobChunk, live func() error) error
	// Abort completes chunks whose copy never ran (cancelled while queued).
	Abort(dir backend.Direction, chunks []sched.JobChunk)
}

// Submit asks for one job's copies. Owner receives exactly one JobDone for it
// while the actor runs; once it stops (or its queue has closed), a load is
// still answered and a store is not: its owner has retired, and one told
// would only decide again in a pool about to go (answerLoads, Queue.refuse).
type Submit struct {
	Owner   *actor.PID
	Engine  string // for spans
	ID      sched.JobID
	Dir     backend.Direction
	Store   Store
	Chunks  []sched.JobChunk
	Bytes   int64             // bytes the copy moves: the in-flight bound's unit
	Span    trace.SpanContext // the job span: the copy span's parent
	Arrived time.Time         // when the batch that caused it arrived (decision latency)
	// Session is the fence generation (Fence.Gen) of the session the copy
	// belongs to, read when that session began: an engine's epoch for a
	// store, the load request for a load. A copy whose session began before
	// a lapse never starts (ErrSessionLapsed).
	Session uint64
	// Hearing is when the node last heard from the engine (nil: not
	// checked): a copy of an engine silent for Config.EngineSilence never
	// starts, and one running is stopped (ErrEngineSilent).
	Hearing *Hearing
	// HearingGen is Hearing.Gen when the copy's session began.
	HearingGen uint64
	queued     time.Time // when it was queued (Queue.Submit; queue wait)
	passed     int       // a store: the loads queued ahead of it since (loadsPastAStore)
	// finished is the copy's completion, filled by the worker that ran it:
	// a Submit is submitted and run once, so its completion (and the
	// owner's JobDone in it) costs no allocation of its own.
	finished copyDone
}

// Cancel removes the owner's queued (not started) jobs; each gets a JobDone
// with Cancelled set. Jobs already copying finish normally.
type Cancel struct {
	Owner *actor.PID
	IDs   []sched.JobID
}

// Drain is sent for an owner that will never take its JobDones again (a
// request actor stopped after a failure): its queued jobs are cancelled as
// by Cancel (pool side aborted; their JobDones go to it all the same), and
// ReplyTo gets Drained once none of its jobs is copying, at once if none
// is (the transfer actor hands it to Queue.DrainThen's mechanism). Its
// blocks may be reused only after that (PROTOCOL.md, released). The owner
// must not submit again.
type Drain struct {
	Owner   *actor.PID
	ReplyTo *actor.PID
	// Then, when set, is run instead of sending Drained, at the same point,
	// on the transfer actor's or a copy worker's goroutine (for a sender
	// that may be gone by then: an engine actor stopping). It must not block, and must touch
	// nothing of an actor but what is safe from another goroutine. A Drain
	// sent after the transfer actor stopped is dropped: Queue.DrainThen
	// holds then too.
	Then func()
}

// Drained answers Drain: no job of Owner is queued or copying.
type Drained struct {
	Owner *actor.PID
}

// JobDone reports the end of a job to its owner. The transfer actor hands
// out completions in batches: More says another JobDone for the same owner
// follows in this batch (a request takes its next store decision after the
// last one).
type JobDone struct {
	ID        sched.JobID
	Err       error // nil: every byte landed
	Cancelled bool
	Bytes     int64
	Duration  time.Duration
	More      bool
}

// completed tells the transfer actor that workers have finished copies
// (queue.finished); one is sent when that list stops being empty.
type completed struct{}

// copyDone is one finished copy, from a worker to the transfer actor; done
// is its owner's JobDone, carried here so a copy costs no allocation for
// it (it lives in its Submit: Submit.finished).
type copyDone struct {
	job  *Submit
	err  error
	dur  time.Duration
	done JobDone
}

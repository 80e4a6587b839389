package load

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/ratelog"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/tracing"
)

// Results of a load (the kvactors_load_requests_total result label).
const (
	ResultOK    = "ok"
	ResultError = "error"
)

// LogCopyFailed is the rate limiter's reason for a failed load copy's line.
const LogCopyFailed = "load_copy_failed"

// Results lists every result label (metrics preset them at 0).
var Results = []string{ResultOK, ResultError}

// Job is one prepared load: its chunks' keys are already pinned in the store.
type Job struct {
	Engine  string
	Request string
	Tokens  int
	Store   transfer.Store // the engine's store: copies, verifies, unpins
	Chunks  []sched.JobChunk
	Bytes   int64
	Reply   string // NATS reply subject
	Ctx     context.Context
	// Span, if set, is the load's span, started when the node took the
	// request (its waits for pending keys inside it), with Ctx carrying it:
	// the actor ends it. Nil: the actor starts one from Ctx.
	Span trace.Span
	// RemoteChunks is how many chunks the node fetched from other nodes of
	// its cluster for this load (the reply's remote_chunks).
	RemoteChunks int
	// Session is the node's fence generation when the load request was
	// taken (transfer.Submit.Session): a lapse since then refuses the copy.
	Session uint64
	// Hearing is when the node last heard from the engine
	// (transfer.Submit.Hearing; nil: not checked).
	Hearing *transfer.Hearing
	// HearingGen is Hearing.Gen when the load was taken.
	HearingGen uint64
}

// Deps is what a load actor needs from its node.
type Deps struct {
	Transfer *actor.PID
	// Queue, when set, takes the load's copy straight (transfer.Queue.Submit),
	// as request actors' stores: a Submit message still in the transfer
	// actor's mailbox when it stops would be dropped unanswered, while the
	// queue answers one it can no longer run (ErrQueueClosed). Nil: the
	// Submit message to Transfer.
	Queue   *transfer.Queue
	Outbox  *actors.Outbox
	Metrics *metrics.Load
	// Unexpected counts messages with no case (nil: not counted).
	Unexpected prometheus.Counter
	Tracer     trace.Tracer
	Log        *slog.Logger
	// Reject rate-limits the line a failed copy logs (nil: none logged):
	// an engine that truncates its own segment makes every load copy fault,
	// and must not choose how many lines the node writes. The failures are
	// counted in full (Metrics.Loads, result error).
	Reject *ratelog.Log
	// Node and Boot name this node in the reply (PROTOCOL.md v2).
	Node, Boot string
	// Done, if set, is called once the load's copy is over (the engine's
	// segments may be unmapped only after it).
	Done func()
}

// Actor runs one load.
type Actor struct {
	deps  Deps
	job   *Job
	span  trace.Span
	start time.Time
	// Each step of the load is marked before it runs, so a turn that
	// panics midway (resumed, then told: resumeOnFailure) never runs a step
	// twice, and the end (failed) does only what is left.
	submitted bool // the copy is handed over: its JobDone comes, and the keys are unpinned there
	ended     bool // its JobDone taken, or it ends without one
	answered  bool // counted and the reply sent
}

// Props builds the actor for one load. Spawn it from the root context: it
// is never restarted (resumeOnFailure).
func Props(deps Deps, job *Job) *actor.Props {
	return actor.PropsFromProducer(func() actor.Actor { return &Actor{deps: deps, job: job} },
		actor.WithGuardian(resumeOnFailure))
}

// resumeOnFailure is the load actors' guardian strategy: protoactor's
// default would restart a failed one, and the fresh instance would submit
// the copy again (keys another copy may have unpinned already) and call
// Done twice. The actor is resumed with its state and told (failed), and
// ends what its failed turn left.
var resumeOnFailure = actors.ResumeOnPanic("load actor failed; resumed to end its load",
	func(reason any) any { return &failed{reason: reason} })

// failed tells a load actor one of its turns panicked (resumeOnFailure).
type failed struct{ reason any }

func (a *Actor) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *actor.Started:
		a.submit(c)
	case *actor.Stopping, *actor.Stopped, *actor.Restarting:
	case *transfer.JobDone:
		a.done(c, m)
	case *failed:
		a.failed(c, m)
	default:
		if a.deps.Unexpected != nil {
			a.deps.Unexpected.Inc()
		}
	}
}

func (a *Actor) submit(c actor.Context) {
	j := a.job
	a.start = time.Now()
	if j.Span != nil {
		a.span = j.Span
		if a.span.IsRecording() { // the variadic attributes are a heap allocation
			a.span.SetAttributes(tracing.AttrChunks.Int(len(j.Chunks)), tracing.AttrBytes.Int64(j.Bytes))
		}
	} else {
		var ctx context.Context
		ctx, a.span = a.deps.Tracer.Start(j.Ctx, tracing.SpanLoad, trace.WithAttributes(
			tracing.AttrEngine.String(j.Engine), tracing.AttrRequest.String(j.Request),
			tracing.AttrChunks.Int(len(j.Chunks)), tracing.AttrBytes.Int64(j.Bytes)))
		j.Ctx = ctx
	}
	if len(j.Chunks) == 0 { // nothing to copy (every target id was 0)
		a.done(c, &transfer.JobDone{})
		return
	}
	sub := &transfer.Submit{Owner: c.Self(), Engine: j.Engine, ID: 1,
		Dir: backend.HostToDevice, Store: j.Store, Chunks: j.Chunks, Bytes: j.Bytes, Span: a.span.SpanContext(),
		Session: j.Session, Hearing: j.Hearing, HearingGen: j.HearingGen}
	a.submitted = true // before: a Submit that panicked may have handed the keys over, and they are not unpinned here under a copy
	if a.deps.Queue != nil {
		a.deps.Queue.Submit(sub)
		return
	}
	c.Send(a.deps.Transfer, sub)
}

func (a *Actor) done(c actor.Context, m *transfer.JobDone) {
	if a.ended {
		return // a second JobDone (not sent by the transfer side)
	}
	a.ended = true // the transfer side unpinned the keys
	var err error
	if m.Err != nil || m.Cancelled {
		err = m.Err
		if err == nil {
			err = fmt.Errorf("load cancelled")
		}
	}
	a.finish(c, err)
}

// failed ends a load whose turn panicked: a copy handed over ends with its
// JobDone (done); otherwise the keys are unpinned here if the copy never
// was submitted, and the load answered, if it was not, as a failed copy.
func (a *Actor) failed(c actor.Context, m *failed) {
	if a.submitted && !a.ended {
		return
	}
	a.ended = true
	if !a.submitted {
		a.submitted = true
		if len(a.job.Chunks) > 0 {
			a.job.Store.Abort(backend.HostToDevice, a.job.Chunks)
		}
	}
	if a.span == nil { // failed before submit took the node's span
		a.span = a.job.Span
	}
	a.finish(c, fmt.Errorf("load actor failed: %v", m.reason))
}

// finish answers the load (err nil: ok), calls Done and stops, each step
// once.
func (a *Actor) finish(c actor.Context, err error) {
	j := a.job
	if !a.answered {
		a.answered = true
		if err != nil {
			if a.span != nil {
				a.span.RecordError(err)
				a.span.SetStatus(codes.Error, err.Error())
			}
			a.deps.Metrics.Loads.WithLabelValues(ResultError).Inc()
			a.deps.Reject.Log(slog.LevelError, LogCopyFailed, "load copy failed", "engine", j.Engine, "request", j.Request,
				"err", err)
			a.deps.Outbox.Reply(j.Ctx, j.Reply, messages.ErrorReply{Error: "copy failed: " + err.Error(),
				Node: a.deps.Node, Boot: a.deps.Boot})
		} else {
			a.deps.Metrics.Loads.WithLabelValues(ResultOK).Inc()
			a.deps.Outbox.Reply(j.Ctx, j.Reply, messages.LoadReply{OK: true, LoadedTokens: j.Tokens,
				Node: a.deps.Node, Boot: a.deps.Boot, RemoteChunks: j.RemoteChunks})
		}
	}
	if done := a.deps.Done; done != nil {
		a.deps.Done = nil
		done()
	}
	if span := a.span; span != nil {
		a.span, j.Span = nil, nil
		span.End()
	}
	c.Stop(c.Self())
}

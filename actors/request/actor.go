package request

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/ratelog"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/tracing"
)

// Store is the node's store as a request actor uses it: decisions prepare
// room (sched.Preparer) and the transfer workers run its copies.
type Store interface {
	sched.Preparer
	transfer.Store
}

// Deps is what a request actor needs from its engine.
type Deps struct {
	Engine string
	// Epoch is the epoch whose events created the request: its releases
	// carry it, also after a newer epoch began (PROTOCOL.md v2 "released").
	Epoch    string
	Releases *actors.Releases
	Layout   *sched.Layout
	Store    Store
	Transfer *actor.PID
	// Queue, when set, is the transfer actor's queue: store jobs are pushed
	// to it directly (no mailbox hop between decision and copy queue);
	// nil: they are sent to Transfer.
	Queue   *transfer.Queue
	Outbox  *actors.Outbox
	Metrics Metrics
	Tracer  trace.Tracer
	Log     *slog.Logger
	// Reject logs rejected events and failed store copies, rate-limited
	// per reason (nil: not logged; they are always counted).
	Reject *ratelog.Log
	// Owed, when set, counts requests not yet released for good (the node
	// reports them when a shutdown times out). The spawner adds the request
	// before spawning it (so none is missed while its actor starts); the
	// actor takes it off with its final release.
	Owed *atomic.Int64
	// Session stamps the requests' copies (transfer.Submit.Session): the
	// node's fence generation when their epoch began.
	Session uint64
	// Hearing is when the node last heard from the engine: its copies
	// never start once it has been silent for lease/2
	// (transfer.ErrEngineSilent; nil: not checked).
	Hearing *transfer.Hearing
	// HearingGen is Hearing.Gen when the requests' epoch began: a copy of
	// an epoch begun before a silence ended never starts.
	HearingGen uint64
	// Timers delivers the requests' RetryDue (one goroutine per engine,
	// not one per pending retry); the engine actor stops it.
	Timers *actors.Timers
}

// Actor is one request's actor. All fields are touched only from Receive.
type Actor struct {
	deps  *Deps          // shared by the engine's requests of one epoch
	state *sched.Request // nil once the request is done (released for good)
	span  trace.Span
	ctx   context.Context // carries span
	jobs  *job            // in flight, a list: a request has few, and a map costs two allocations
	// unsubmitted is the job a decision made (its room reserved in the
	// pool, pending) until submit hands it to the copy queue: if the turn
	// panics in between, the actor's stop frees that room (abortUnsubmitted),
	// or it would stay pending for good, its keys held back from every
	// other request offering them.
	unsubmitted *sched.StoreJob
	// retryArmed: a retry is armed (its timer or an early wake-up will
	// decide again); later retries wait for it. arm numbers the retries
	// armed for this request: an early wake-up of an earlier one, or a
	// second one of this one, is stale. timer is the arm whose RetryDue
	// timer has not fallen due yet (0: none): it decides for whichever
	// retry is armed when it does (armRetry).
	retryArmed bool
	arm        uint32
	timer      uint32
	// waiting is the retry its early wake-ups may still take (waitKey), 0
	// when none: read by the pool's room queue on other goroutines to skip
	// wake-ups no longer wanted. Allocated at the first wait, kept on reuse.
	waiting  *atomic.Uint64
	released string // the request's id once done (state is dropped then)
	// lastJob is the latest job ID of the actor's requests: the next one's
	// jobs are numbered after it, since the transfer side matches a Cancel
	// by owner and ID, and one sent for an earlier request may still be on
	// its way when this actor serves the next.
	lastJob sched.JobID
	// decideAfterJobs: a completion of this batch calls for a decision
	// after the owner's last one (JobDone.More).
	decideAfterJobs bool
	// gen counts the requests this actor has served (Spawner reuses a
	// released one): a RetryDue armed for an earlier one is ignored.
	gen uint32
	// releasing, when set, is raised, with its reason, before the request's
	// final release is published (SpawnWatched): its engine actor stops routing to this actor
	// at once, so an engine that reuses the request id as soon as it reads
	// the release gets a new request, not this finished one, which would
	// drop its events (the Done message may reach the engine actor later).
	releasing *Releasing
}

// noSpan is a request's or job's span with tracing off: a no-op, ended
// like any other.
var noSpan = trace.SpanFromContext(context.Background())

// LogCopyFailed is the rate limiter's reason for a failed store copy's line.
const LogCopyFailed = "store_copy_failed"

// tracingOff reports a no-op tracer: its spans record nothing, yet starting
// one still allocates a context, once per request and once per job.
func tracingOff(t trace.Tracer) bool {
	_, off := t.(noop.Tracer)
	return off
}

func (unexpectedRestart) Receive(c actor.Context) {
	if _, ok := c.Message().(*actor.Started); ok {
		c.Stop(c.Self())
	}
}

// isDone: the request was released for good; the actor waits for reuse.
func (a *Actor) isDone() bool { return a.state == nil }

func newActor(deps *Deps, added *messages.Event, parent context.Context, releasing *Releasing) *Actor {
	a := &Actor{}
	a.init(deps, added, parent, releasing)
	return a
}

// init starts the actor's next request (a new actor's first).
func (a *Actor) init(deps *Deps, added *messages.Event, parent context.Context, releasing *Releasing) {
	*a = Actor{deps: deps, state: sched.NewRequest(deps.Layout, added), gen: a.gen + 1, lastJob: a.lastJob,
		releasing: releasing, waiting: a.waiting}
	a.stopWaiting()                 // an earlier request's wake-ups are stale
	a.state.ContinueJobs(a.lastJob) // (owner, job id) names one job for good: see lastJob
	if tracingOff(deps.Tracer) {
		// The no-op tracer's span only carries the parent's span context,
		// and starting it allocates a context: the parent does the same.
		a.ctx, a.span = parent, noSpan
		return
	}
	a.ctx, a.span = deps.Tracer.Start(parent, tracing.SpanRequest)
	if a.span.IsRecording() { // attributes cost allocations even for a no-op span
		a.span.SetAttributes(tracing.AttrEngine.String(deps.Engine), tracing.AttrRequest.String(a.state.ID()))
	} else if a.span.SpanContext().Equal(trace.SpanContextFromContext(parent)) {
		// A no-op tracer's span only carries the parent's span context:
		// the parent context propagates the same, without a context value
		// held by every live request.
		a.ctx = parent
	}
}

func (a *Actor) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *actor.Started:
		a.deps.Metrics.RequestsLive.Inc()
	case *assign:
		a.init(m.deps, &m.added, m.parent, m.releasing)
		a.deps.Metrics.RequestsLive.Inc()
	case *actor.Stopping:
	case *actor.Stopped, *actor.Restarting:
		if !a.isDone() {
			// First: a panic in what follows must not keep the engine's
			// budget charged for good.
			a.state.Forget()
		}
		a.stopWaiting() // nothing of it waits any more
		a.abortUnsubmitted()
		a.endJobSpans()
		// Restarting is this instance's last message too: the replacement
		// (unexpectedRestart) has none of its state, so it ends here. A
		// released request settled its accounts when it was done. A watched
		// one (SpawnWatched) stays owed: its engine actor releases it, and
		// settles the count then; lowered here, a shutdown count taken before
		// the engine handles the stop would miss it.
		if !a.isDone() {
			a.deps.Metrics.RequestsLive.Dec()
			a.span.SetStatus(codes.Error, "request actor stopped before release")
			if a.deps.Owed != nil && a.releasing == nil {
				a.deps.Owed.Add(-1)
			}
			a.span.End()
		}
	case *Events:
		a.apply(c, m)
		if m.Applied != nil {
			m.Applied.Signal()
		}
	case *transfer.JobDone:
		a.jobDone(c, m)
	case *RetryDue:
		if m.gen != a.gen || a.isDone() {
			break // armed for an earlier request of this actor, or nothing owed
		}
		if !m.woken {
			if m.arm != a.timer {
				break // a timer already taken
			}
			a.timer = 0
		} else if m.arm != a.arm {
			break // an earlier retry's wake-up
		}
		if !a.retryArmed {
			break // taken already: by a wake-up, or decided since
		}
		a.retryArmed = false
		a.stopWaiting()
		if m.woken {
			a.perform(c, a.state.AdvanceWoken(a.deps.Store), time.Time{})
			break
		}
		a.perform(c, a.state.Advance(a.deps.Store), time.Time{})
	case *Hold:
		if !a.isDone() {
			a.state.Hold()
		}
	case *Unhold:
		if !a.isDone() {
			a.perform(c, a.state.Unhold(), time.Time{})
		}
	case *Reset:
		if a.isDone() {
			break // released for good: nothing is owed
		}
		a.span.AddEvent(m.Reason)
		a.perform(c, a.state.Reset(m.Reason), time.Time{})
	case *StatusQuery:
		if a.isDone() { // a gather that asked before the release: its state is gone
			c.Send(m.ReplyTo, &Status{Snapshot: sched.RequestSnapshot{Request: a.released, Phase: sched.Done}})
			break
		}
		c.Send(m.ReplyTo, &Status{Snapshot: a.state.Snapshot()})
	default:
		a.deps.Metrics.Unexpected.Inc()
	}
}

func (a *Actor) apply(c actor.Context, m *Events) {
	if a.isDone() {
		// Routed before the release raised releasing (its engine actor
		// rejects later ones itself): rejected as Step rejects an event
		// for a Done request (PROTOCOL.md, rejections: released).
		for i := range m.Events {
			a.reject(&m.Events[i], sched.ErrReleased)
		}
		return
	}
	applied := 0
	for i := range m.Events {
		ev := &m.Events[i]
		if err := a.state.Step(ev); err != nil {
			a.reject(ev, err)
			continue
		}
		applied++
	}
	a.deps.Metrics.EventsApplied.Add(float64(applied))
	a.perform(c, a.state.Advance(a.deps.Store), m.Arrived)
}

// reject logs and counts a rejected event; the state is unchanged.
func (a *Actor) reject(ev *messages.Event, err error) {
	reason := messages.RejectLabel(err)
	a.deps.Metrics.Rejected.WithLabelValues(reason).Inc()
	a.deps.Reject.Reject(reason, "event rejected", "engine", a.deps.Engine, "request", ev.Request,
		"type", ev.Type.String(), "err", err)
}

// perform carries out effects in the documented order (sched.Effects).
func (a *Actor) perform(c actor.Context, eff sched.Effects, arrived time.Time) {
	if eff.More { // a decision capped to what the pool holds, with no job to decide again after
		defer func() {
			if !a.isDone() {
				a.perform(c, a.state.Advance(a.deps.Store), arrived)
			}
		}()
	}
	if eff.Job != nil {
		a.unsubmitted = eff.Job // until submit hands it over
	}
	if len(eff.Cancel) > 0 {
		c.Send(a.deps.Transfer, &transfer.Cancel{Owner: c.Self(), IDs: eff.Cancel})
	}
	if eff.Job != nil {
		a.submit(c, eff.Job, arrived)
	}
	if eff.Evicted > 0 {
		a.evicted(eff.Evicted)
	}
	if eff.Deduped > 0 { // an atomic add on a counter every core shares: not for nothing
		a.deps.Metrics.ChunksDeduped.Add(float64(eff.Deduped))
	}
	// Span events are built only for a recording span: with tracing off
	// their attribute lists would be the cost.
	recording := a.span.IsRecording()
	for _, d := range eff.Deferred.All() {
		a.deps.Metrics.Deferral(d.Reason.String()).Inc()
		if recording {
			a.span.AddEvent(tracing.EventDeferred, trace.WithAttributes(
				tracing.AttrGroup.Int(d.Group), tracing.AttrChunk.Int(int(d.Chunk)),
				tracing.AttrReason.String(d.Reason.String())))
		}
	}
	if r := eff.Retry; r != nil {
		// Counted and traced only when it arms a retry: a failed decision
		// while one is armed (a batch for a request waiting for room)
		// schedules nothing. One that takes over a running timer (an early
		// wake-up's that failed again) has no backoff of its own.
		if armed, timed := a.armRetry(c, r, eff.Pending, eff.RoomGen); armed {
			a.deps.Metrics.Retry(r.Reason.String()).Inc()
			if recording {
				attrs := []attribute.KeyValue{tracing.AttrReason.String(r.Reason.String()),
					tracing.AttrAttempt.Int(r.Attempt)}
				if timed {
					attrs = append(attrs, tracing.AttrBackoffMS.Int64(r.Backoff.Milliseconds()))
				}
				a.span.AddEvent(tracing.EventRetry, trace.WithAttributes(attrs...))
			}
		}
	}
	if eff.GivenUp > 0 {
		reason := eff.GivenUpReason.String()
		a.deps.Metrics.ChunksDropped.Add(float64(eff.GivenUp))
		if recording {
			a.span.AddEvent(tracing.EventDropped, trace.WithAttributes(
				tracing.AttrChunks.Int(eff.GivenUp), tracing.AttrReason.String(reason)))
		}
		a.deps.Log.Error("gave up storing ready chunks", "engine", a.deps.Engine, "request", a.state.ID(),
			"chunks", eff.GivenUp, "reason", reason)
	}
	if eff.Done && a.releasing != nil && len(eff.Releases) == 0 {
		a.releasing.raise("") // nothing to publish: done all the same
	}
	owedSettled := false
	for i, reason := range eff.Releases {
		final := eff.Done && i == len(eff.Releases)-1
		var then func()
		if final && a.deps.Owed != nil {
			// The final release and the owed count change together, so a
			// shutdown never counts a release both sent and owed.
			then = func() { a.deps.Owed.Add(-1) }
			owedSettled = true
		}
		if final && a.releasing != nil {
			// Before the release goes out (see Releasing), and just before:
			// a panic ahead of the publish leaves it down, so the engine
			// releases the failed request itself, aborted, and settles its
			// owed count.
			a.releasing.raise(reason)
		}
		if a.deps.Releases.Publish(a.ctx, a.deps.Epoch, a.state.ID(), reason, then) {
			// Counted once it is out: a panic before the publish is counted
			// by the engine's own release of the failed request, not twice.
			a.deps.Metrics.Release(reason).Inc()
		} else {
			owedSettled = true // sealed: stays owed, and the shutdown reports it
		}
		if recording {
			a.span.AddEvent("released", trace.WithAttributes(tracing.AttrReason.String(reason)))
		}
	}
	if eff.Done {
		if a.deps.Owed != nil && !owedSettled {
			a.deps.Owed.Add(-1)
		}
		if len(eff.Releases) > 0 && recording {
			a.span.SetAttributes(tracing.AttrReason.String(eff.Releases[len(eff.Releases)-1]))
		}
		a.span.End()
		a.deps.Metrics.RequestsLive.Dec()
		if p := c.Parent(); p != nil {
			done := &Done{Request: a.state.ID(), PID: c.Self()}
			if k := len(eff.Releases); k > 0 {
				done.Reason = eff.Releases[k-1]
			}
			c.Send(p, done)
		}
		// An idle actor keeps no request state (a long prompt's hashes and
		// block ids, a recorded span and its batch's context): only its id,
		// for a status gather that asked late.
		a.state.Forget() // its hashes and block ids go with it: the engine's budget has them back
		a.released, a.lastJob, a.state = a.state.ID(), a.state.LastJob(), nil
		a.stopWaiting() // its wake-ups still queued are stale: they pass their turn on
		a.span, a.ctx = noSpan, context.Background()
	}
}

// evicted counts a decision's evictions; the pool's journal announces
// them (BlockRemoved, in order with the stores).
func (a *Actor) evicted(n int) {
	a.deps.Metrics.Evictions.Add(float64(n))
}

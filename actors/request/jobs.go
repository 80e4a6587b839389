package request

// A request's store jobs: submitted to the copy queue, tracked until their
// JobDone, and what a completed, failed or cancelled one changes.

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
	"github.com/kvactors/kvactors/tracing"
	"github.com/kvactors/kvactors/wire"
)

type job struct {
	// sub is what the copy queue holds, kept here so a job is one
	// allocation; it is the transfer side's until the job's JobDone.
	sub  transfer.Submit
	span trace.Span
	ctx  context.Context
	next *job
}

// takeJob unlinks and returns the job in flight with id, nil if none.
func (a *Actor) takeJob(id sched.JobID) *job {
	for p := &a.jobs; *p != nil; p = &(*p).next {
		if j := *p; j.sub.ID == id {
			*p, j.next = j.next, nil
			return j
		}
	}
	return nil
}

// endJobSpans ends the spans of the jobs still in flight as the actor
// ends: no JobDone will reach it to end them. The copies themselves are the
// transfer side's.
func (a *Actor) endJobSpans() {
	for j := a.jobs; j != nil; j = j.next {
		j.span.SetStatus(codes.Error, "request actor stopped before the job ended")
		j.span.End()
	}
	a.jobs = nil
}

func (a *Actor) jobDone(c actor.Context, m *transfer.JobDone) {
	if m.Err != nil {
		// A failure waits for its retry timer (so it backs off); a decision
		// owed to an earlier completion of the batch is taken before it, as
		// if each completion had come alone.
		a.decideOwed(c)
	}
	if j := a.takeJob(m.ID); j != nil {
		a.jobEnded(c, j, m)
	} else {
		a.deps.Metrics.Unexpected.Inc()
	}
	if !m.More {
		a.decideOwed(c)
	}
}

// decideOwed takes the decision that completed or cancelled jobs call for
// (they can leave chunks to offer: a cancelled job's chunks once blocks are
// tracked again), once per batch of this owner's completions.
func (a *Actor) decideOwed(c actor.Context) {
	if a.decideAfterJobs && !a.isDone() {
		a.perform(c, a.state.Advance(a.deps.Store), time.Time{})
	}
	a.decideAfterJobs = false
}

func (a *Actor) jobEnded(c actor.Context, j *job, m *transfer.JobDone) {
	success := m.Err == nil && !m.Cancelled // the transfer side completed the pool
	switch {
	case success:
		a.published(j)
		if j.span.IsRecording() { // the attribute list escapes: not for a no-op span
			j.span.SetAttributes(tracing.AttrBytes.Int64(m.Bytes))
		}
	case m.Cancelled:
		j.span.AddEvent("cancelled")
	default:
		j.span.RecordError(m.Err)
		j.span.SetStatus(codes.Error, m.Err.Error())
		level := slog.LevelWarn
		if errors.Is(m.Err, transfer.ErrSessionLapsed) || errors.Is(m.Err, transfer.ErrEngineSilent) {
			// Expected after a lapse, on every retry until the engine's
			// reset ends the request: the fence counts them.
			level = slog.LevelDebug
		}
		// Rate-limited: an engine that truncates its own segment makes
		// every copy fault (counted in full: transfer failures, retries).
		a.deps.Reject.Log(level, LogCopyFailed, "store copy failed; will retry", "engine", a.deps.Engine,
			"request", a.state.ID(), "job", m.ID, "err", m.Err)
	}
	j.span.End()
	a.perform(c, a.state.JobDone(m.ID, success, m.Cancelled), time.Time{})
	if m.Err == nil {
		a.decideAfterJobs = true
	}
}

// published tells the engine of a completed store job (stored). Routers
// learn of its chunks from the pool's journal: BlockStored as the copy
// completed, in order with every eviction (PROTOCOL.md, "kv_events").
// A job whose message would pass the server's max_payload (a long-context
// prompt's thousands of chunks) goes out in several, each with the job's
// number, its own chunks and their bytes: one refused whole would be lost.
func (a *Actor) published(j *job) {
	chunks := j.sub.Chunks
	a.deps.Metrics.ChunksStored.Add(float64(len(chunks)))
	defer a.observeStored(j)
	id, limit := a.state.ID(), a.deps.Outbox.BodyMax()
	for len(chunks) > 0 {
		n, size := storedFit(id, chunks, limit)
		part, bytes := chunks[:n], j.sub.Bytes
		if n < len(j.sub.Chunks) {
			bytes = store.CopyBytes(a.deps.Layout, part)
		}
		chunks = chunks[n:]
		a.deps.Outbox.Stored(j.ctx, a.deps.Engine, func(b []byte) []byte {
			b = slices.Grow(b, size) // one growth, not one per chunk, for a long-context job
			b = wire.AppendStoredOpen(b, id, uint64(j.sub.ID))
			for i, ch := range part {
				if i > 0 {
					b = append(b, ',')
				}
				b = wire.AppendStoredChunkHex(b, ch.Group, int(ch.Index), string(sched.WireKey(ch.Key)))
			}
			return wire.AppendStoredClose(b, bytes)
		})
	}
}

// storedFit is how many of chunks, from the first, one stored message of
// request id holds within limit bytes of body (at least one; limit 0: all),
// and the body's size at most. Sizes are upper bounds: an id's characters
// escaped in full, numbers at their longest.
func storedFit(id string, chunks []sched.JobChunk, limit int) (n, size int) {
	size = len(`{"request":,"job":,"chunks":[],"bytes":}`) + 2 + 6*len(id) + 2*20
	for n < len(chunks) {
		add := len(`,{"group":,"index":,"key":""}`) + 2*20 + 2*len(sched.WireKey(chunks[n].Key))
		if n > 0 && limit > 0 && size+add > limit {
			break
		}
		size += add
		n++
	}
	return n, size
}

// observeStored times the job from its batch's arrival to its stored
// message's publish (after it, so the publish is counted).
func (a *Actor) observeStored(j *job) {
	if !j.sub.Arrived.IsZero() {
		a.deps.Metrics.StoredTime.Observe(time.Since(j.sub.Arrived).Seconds())
	}
}

// abortUnsubmitted frees the room of a job its decision reserved and its
// failed turn never handed to the copy queue (unsubmitted), as the actor
// stops. The engine's Drain cancels only what reached the queue.
func (a *Actor) abortUnsubmitted() {
	if j := a.unsubmitted; j != nil {
		a.unsubmitted = nil
		a.deps.Store.Abort(backend.DeviceToHost, j.Chunks)
	}
}

func (a *Actor) submit(c actor.Context, sj *sched.StoreJob, arrived time.Time) {
	bytes := store.CopyBytes(a.deps.Layout, sj.Chunks)
	ctx, span := a.ctx, noSpan
	if !tracingOff(a.deps.Tracer) {
		ctx, span = a.deps.Tracer.Start(a.ctx, tracing.SpanStoreJob)
	}
	if span.IsRecording() {
		span.SetAttributes(tracing.AttrJob.Int64(int64(sj.ID)), tracing.AttrChunks.Int(len(sj.Chunks)),
			tracing.AttrBytes.Int64(bytes))
	}
	j := &job{span: span, ctx: ctx, sub: transfer.Submit{Owner: c.Self(), Engine: a.deps.Engine, ID: sj.ID,
		Dir: backend.DeviceToHost, Store: a.deps.Store, Chunks: sj.Chunks, Bytes: bytes,
		Span: span.SpanContext(), Arrived: arrived, Session: a.deps.Session, Hearing: a.deps.Hearing,
		HearingGen: a.deps.HearingGen}, next: a.jobs}
	a.jobs = j
	sub := &j.sub
	// Handed over before the call: a Submit that panics may have queued
	// the job, whose copy or abort then completes its room; aborted here
	// too, it would be completed twice.
	a.unsubmitted = nil
	if a.deps.Queue != nil {
		a.deps.Queue.Submit(sub)
	} else {
		c.Send(a.deps.Transfer, sub)
	}
}

package tracing

import (
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// TracerName is the instrumentation scope of every kvactors span.
const TracerName = "github.com/kvactors/kvactors"

// Tracer returns kvactors' tracer from tp, so that no caller repeats the
// scope name.
func Tracer(tp trace.TracerProvider) trace.Tracer { return tp.Tracer(TracerName) }

// Span names: one scheme, "kvactors.<what>".
const (
	// SpanBatch covers the handling of one P.E.events batch; its parent is
	// the engine's span from the message's traceparent header, if any.
	SpanBatch = "kvactors.batch"
	// SpanRequest lives as long as a request is tracked (added .. released).
	SpanRequest = "kvactors.request"
	// SpanStoreJob covers one store job, from prepare_store to completion.
	SpanStoreJob = "kvactors.store_job"
	// SpanCopy covers one device<->host copy of a job.
	SpanCopy = "kvactors.copy"
	// SpanLoad covers one P.E.load request, from intake taking it off NATS
	// (its wait behind the engine's earlier messages included) to the
	// reply: refusals, remote fetches and waits for pending keys included.
	SpanLoad = "kvactors.load"
	// SpanLookup covers one P.E.lookup request, from intake taking it to
	// the reply.
	SpanLookup = "kvactors.lookup"
)

// Span event names.
const (
	// EventDeferred: a chunk is waiting for a lagging term (AttrReason says
	// which: tokens, hashes or blocks).
	EventDeferred = "deferred"
	// EventRetry: a failed store decision armed a retry (AttrReason why), due
	// after AttrBackoffMS (absent: on a timer already running; AttrAttempt).
	EventRetry = "retry"
	// EventDropped: a finishing request gave up its ready chunks after the
	// retry limit (AttrChunks of them; AttrReason: the last failure's).
	EventDropped = "dropped"
	// EventWaitEnded: a load's wait for keys pending in another copy ended
	// (AttrOutcome says how, AttrWaitMS after how long).
	EventWaitEnded = "wait_ended"
)

// Attribute keys: one scheme, "kvactors.<what>".
const (
	AttrEngine    attribute.Key = "kvactors.engine"     // engine id
	AttrRequest   attribute.Key = "kvactors.request"    // request id
	AttrGroup     attribute.Key = "kvactors.group"      // group index
	AttrChunk     attribute.Key = "kvactors.chunk"      // chunk index in its group
	AttrReason    attribute.Key = "kvactors.reason"     // why (deferral, release, rejection)
	AttrAttempt   attribute.Key = "kvactors.attempt"    // retry attempt, from 1
	AttrBackoffMS attribute.Key = "kvactors.backoff_ms" // retry delay in milliseconds
	AttrJob       attribute.Key = "kvactors.job"        // store job id
	AttrBytes     attribute.Key = "kvactors.bytes"      // bytes copied
	AttrChunks    attribute.Key = "kvactors.chunks"     // chunks in a job or load
	AttrDirection attribute.Key = "kvactors.direction"  // backend.Direction: "GPU_to_CPU" (store) or "CPU_to_GPU" (load)
	AttrSeq       attribute.Key = "kvactors.seq"        // batch seq
	AttrEvents    attribute.Key = "kvactors.events"     // events in a batch
	AttrHashes    attribute.Key = "kvactors.hashes"     // hashes in a lookup
	AttrHitTokens attribute.Key = "kvactors.hit_tokens" // tokens a lookup hit
	AttrOutcome   attribute.Key = "kvactors.outcome"    // how a load's wait ended
	AttrWaitMS    attribute.Key = "kvactors.wait_ms"    // a load's wait in milliseconds
)

package node

// The context an inbound message's work runs in: the engine's remote span
// context, and a batch's span with tracing on.

import (
	"context"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/tracing"
)

// msgCtx is the context an inbound message's work runs in: Background
// (nothing per message) plus the engine's remote span context, and nothing
// else of its headers, since a request keeps it until its release
// (tracing.Extract). With tracing off only the traceparent is read: it is
// all the node passes back, on stored, released and replies.
func (n *Node) msgCtx(m *nats.Msg) context.Context {
	if m.Header == nil {
		return context.Background()
	}
	if !n.traced {
		return tracing.ExtractTraceparent(context.Background(), m.Header)
	}
	return tracing.Extract(context.Background(), m.Header)
}

// batchCtx is the context a batch's requests start in: msgCtx under the
// batch's span, which marks its arrival (request spans hang below it).
// With tracing off there is no span to start: a no-op one would still cost
// a context per batch, held by each request the batch adds.
func (n *Node) batchCtx(m *nats.Msg, engineID string, seq uint64, events int) context.Context {
	ctx := n.msgCtx(m)
	if !n.traced {
		return ctx
	}
	ctx, span := n.tracer.Start(ctx, tracing.SpanBatch)
	if span.IsRecording() {
		span.SetAttributes(tracing.AttrEngine.String(engineID), tracing.AttrSeq.Int64(int64(seq)),
			tracing.AttrEvents.Int(events))
	}
	span.End()
	return ctx
}

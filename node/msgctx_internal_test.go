package node

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/tracing"
)

// HostileTraceHeader is what a hostile engine may put on every message: a
// valid traceparent, an 8 KB baggage of 64 members and a 14.5 KB
// tracestate of 32 entries whose first, "engine=kept", is the only one
// within W3C's 128-character member limit for truncation.
func HostileTraceHeader(traceparent string) nats.Header {
	bag := make([]string, 64)
	for i := range bag {
		bag[i] = fmt.Sprintf("k%02d=%s", i, strings.Repeat("v", 120))
	}
	ts := []string{"engine=kept"}
	for i := 1; i < 32; i++ {
		// Valid for OTel's parser (keys and values within 256 characters),
		// so only kvactors' bound drops them.
		ts = append(ts, fmt.Sprintf("v%02d%s=%s", i, strings.Repeat("k", 200), strings.Repeat("s", 250)))
	}
	return nats.Header{"traceparent": {traceparent}, "Tracestate": {strings.Join(ts, ",")},
		"Baggage": {strings.Join(bag, ",")}}
}

// The context msgCtx hands to actors (a batch's, and so each new request's
// until its release) keeps the engine's span context and nothing else of a
// message's headers: no baggage, a tracestate within tracing.MaxTraceState
// (none with tracing off). The message comes through a real NATS server, so
// its header values are what nats.go decodes (substrings of one block).
func TestMsgCtxKeepsOnlyTheSpanContext(t *testing.T) {
	_, nc := testkit.NATS(t)
	sub, err := nc.SubscribeSync("kvactors.e1.events")
	require.NoError(t, err)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	out := nats.NewMsg("kvactors.e1.events")
	out.Header = HostileTraceHeader(tp)
	out.Data = []byte("{}")
	require.NoError(t, nc.PublishMsg(out))
	m, err := sub.NextMsg(5 * time.Second)
	require.NoError(t, err, "the message with big headers")
	require.Equal(t, out.Header["Baggage"], m.Header["Baggage"], "NATS delivered the baggage")

	for _, traced := range []bool{true, false} {
		ctx := (&Node{traced: traced}).msgCtx(m)
		require.Zero(t, baggage.FromContext(ctx).Len(), "traced=%v: no baggage kept", traced)
		sc := trace.SpanContextFromContext(ctx)
		require.True(t, sc.IsValid() && sc.IsRemote() && sc.IsSampled(), "traced=%v: the engine's span is the parent", traced)
		require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", sc.TraceID().String())
		require.Equal(t, "00f067aa0ba902b7", sc.SpanID().String())
		want := ""
		if traced {
			want = "engine=kept" // W3C truncation: members over 128 characters go first
		}
		got := sc.TraceState().String() // at most tracing.MaxTraceState bytes
		require.True(t, got == want, "traced=%v: tracestate of %d bytes kept, want %q", traced, len(got), want)
	}
}

// With tracing off (the default) a batch's context costs nothing: a
// batch without trace headers allocates no context for a no-op batch
// span, and one with a traceparent keeps the engine's span context. With
// tracing on, the batch span is recorded, a child of the engine's, and
// the batch's context carries it (its requests' spans hang below it).
func TestBatchCtxStartsASpanOnlyWithTracingOn(t *testing.T) {
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	plain := &nats.Msg{Subject: "kvactors.e1.events", Data: []byte("{}")}
	traced := &nats.Msg{Subject: "kvactors.e1.events", Data: []byte("{}"), Header: nats.Header{"traceparent": {tp}}}

	off := &Node{tracer: tracing.Tracer(noop.NewTracerProvider())}
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = off.batchCtx(plain, "e1", 1, 4) }),
		"tracing off: a batch without trace headers allocates nothing")
	require.Equal(t, "00f067aa0ba902b7", trace.SpanContextFromContext(off.batchCtx(traced, "e1", 1, 4)).SpanID().String(),
		"tracing off: the engine's span context is kept")

	rec := tracetest.NewSpanRecorder()
	on := &Node{traced: true, tracer: tracing.Tracer(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))}
	ctx := on.batchCtx(traced, "e1", 7, 4)
	ended := rec.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, tracing.SpanBatch, ended[0].Name())
	require.Equal(t, "00f067aa0ba902b7", ended[0].Parent().SpanID().String())
	require.Contains(t, ended[0].Attributes(), tracing.AttrSeq.Int64(7))
	require.Equal(t, ended[0].SpanContext().SpanID(), trace.SpanContextFromContext(ctx).SpanID(),
		"the batch's context carries its span")
}

// A lookup's or a load's span (verbSpan) costs nothing with tracing off:
// no allocation, with or without the engine's traceparent, and the span
// returned carries the engine's span context, which the reply passes back.
// With tracing on it is recorded from taken, a child of the engine's span,
// and the context returned carries it (the reply passes it back).
func TestVerbSpanStartsASpanOnlyWithTracingOn(t *testing.T) {
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	plain := &nats.Msg{Subject: "kvactors.e1.lookup", Data: []byte("{}")}
	traced := &nats.Msg{Subject: "kvactors.e1.lookup", Data: []byte("{}"), Header: nats.Header{"traceparent": {tp}}}
	taken := time.Now()

	off := &Node{tracer: tracing.Tracer(noop.NewTracerProvider())}
	for _, m := range []*nats.Msg{plain, traced} {
		ctx := off.msgCtx(m)
		allocs := testing.AllocsPerRun(100, func() {
			_, span := off.verbSpan(ctx, tracing.SpanLookup, "e1", taken)
			span.End()
		})
		require.Zero(t, allocs, "tracing off: a lookup's span allocates nothing (headers: %v)", m.Header)
	}
	ctx, span := off.verbSpan(off.msgCtx(traced), tracing.SpanLoad, "e1", taken)
	require.False(t, span.IsRecording())
	require.Equal(t, "00f067aa0ba902b7", span.SpanContext().SpanID().String(), "tracing off: the engine's span")
	require.Equal(t, "00f067aa0ba902b7", trace.SpanContextFromContext(ctx).SpanID().String(),
		"tracing off: the reply passes the engine's span context back")

	rec := tracetest.NewSpanRecorder()
	on := &Node{traced: true, tracer: tracing.Tracer(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))}
	ctx, span = on.verbSpan(on.msgCtx(traced), tracing.SpanLoad, "e1", taken)
	require.True(t, span.IsRecording())
	span.End()
	ended := rec.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, tracing.SpanLoad, ended[0].Name())
	require.Equal(t, "00f067aa0ba902b7", ended[0].Parent().SpanID().String())
	require.Equal(t, taken.UnixNano(), ended[0].StartTime().UnixNano(), "the span starts when intake took the message")
	require.Contains(t, ended[0].Attributes(), tracing.AttrEngine.String("e1"))
	require.Equal(t, ended[0].SpanContext().SpanID(), trace.SpanContextFromContext(ctx).SpanID(),
		"the context the reply goes out in carries the load's span")
}

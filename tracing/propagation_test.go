package tracing

import (
	"context"
	"sort"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func TestHeaderCarrierRoundTrip(t *testing.T) {
	t.Parallel()
	h := nats.Header{}
	c := HeaderCarrier(h)
	c.Set("traceparent", "tp")
	c.Set("Tracestate", "ts") // stored lowercase, as W3C spells it
	require.Equal(t, "tp", c.Get("traceparent"))
	require.Equal(t, "ts", c.Get("tracestate"))
	require.Equal(t, []string{"ts"}, h["tracestate"])
	require.Equal(t, "", c.Get("baggage"))
	keys := c.Keys()
	sort.Strings(keys)
	require.Equal(t, []string{"traceparent", "tracestate"}, keys)
}

func TestHeaderCarrierGetIsCaseInsensitive(t *testing.T) {
	t.Parallel()
	c := HeaderCarrier{"Traceparent": {"upper"}, "X-Other": {"x"}}
	require.Equal(t, "upper", c.Get("traceparent"))
	c["traceparent"] = []string{"exact"}
	require.Equal(t, "exact", c.Get("traceparent"), "the exact key wins")
}

func TestHeaderCarrierSetReplacesOtherSpellings(t *testing.T) {
	t.Parallel()
	c := HeaderCarrier{"Traceparent": {"stale"}, "Other": {"kept"}}
	c.Set("traceparent", "fresh")
	require.Equal(t, HeaderCarrier{"traceparent": {"fresh"}, "Other": {"kept"}}, c)
}

// TestExtractHandWrittenHeader: an engine (not using OTel's NATS helpers)
// writes "Traceparent" with a capital T; kvactors still finds its span.
func TestExtractHandWrittenHeader(t *testing.T) {
	t.Parallel()
	h := nats.Header{}
	h["Traceparent"] = []string{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	h["Tracestate"] = []string{"vendor=x"}
	sc := trace.SpanContextFromContext(Extract(context.Background(), h))
	require.True(t, sc.IsValid())
	require.True(t, sc.IsRemote())
	require.True(t, sc.IsSampled())
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", sc.TraceID().String())
	require.Equal(t, "00f067aa0ba902b7", sc.SpanID().String())
	require.Equal(t, "vendor=x", sc.TraceState().String())
}

func TestExtractWithoutHeaders(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	require.False(t, trace.SpanContextFromContext(Extract(ctx, nil)).IsValid())
	require.False(t, trace.SpanContextFromContext(Extract(ctx, nats.Header{"traceparent": {"garbage"}})).IsValid())
}

// TestInjectThenExtractKeepsTheTrace: kvactors' child span of a batch, sent
// on to another subscriber, stays in the engine's trace.
func TestInjectThenExtractKeepsTheTrace(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { require.NoError(t, tp.Shutdown(context.Background())) })

	member, err := baggage.NewMember("engine", "e1")
	require.NoError(t, err)
	bag, err := baggage.New(member)
	require.NoError(t, err)
	ctx, span := Tracer(tp).Start(baggage.ContextWithBaggage(context.Background(), bag), SpanBatch)
	m := nats.NewMsg("kvactors.e1.events")
	InjectMsg(ctx, m)
	span.End()
	require.Contains(t, m.Header, "traceparent")

	got := Extract(context.Background(), m.Header)
	sc := trace.SpanContextFromContext(got)
	require.Equal(t, span.SpanContext().TraceID(), sc.TraceID())
	require.Equal(t, span.SpanContext().SpanID(), sc.SpanID())
	require.Equal(t, "e1", baggage.FromContext(got).Member("engine").Value())

	_, child := Tracer(tp).Start(got, SpanRequest)
	child.End()
	ended := rec.Ended()
	require.Len(t, ended, 2)
	require.Equal(t, span.SpanContext().SpanID(), ended[1].Parent().SpanID())
}

func TestInjectMsgCreatesHeader(t *testing.T) {
	t.Parallel()
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { require.NoError(t, tp.Shutdown(context.Background())) })
	ctx, span := Tracer(tp).Start(context.Background(), SpanLoad)
	defer span.End()
	m := &nats.Msg{Subject: "x"}
	InjectMsg(ctx, m)
	require.NotEmpty(t, m.Header.Get("traceparent"))
}

package tracing

import (
	"context"
	"sort"
	"strings"
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
// on to another subscriber, stays in the engine's trace; baggage in the
// context is neither written nor read.
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
	require.NotContains(t, m.Header, "baggage")
	m.Header["baggage"] = []string{"engine=e1"}

	got := Extract(context.Background(), m.Header)
	sc := trace.SpanContextFromContext(got)
	require.Equal(t, span.SpanContext().TraceID(), sc.TraceID())
	require.Equal(t, span.SpanContext().SpanID(), sc.SpanID())
	require.Zero(t, baggage.FromContext(got).Len())

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

func TestBoundTraceState(t *testing.T) {
	t.Parallel()
	long := func(k string, n int) string { return k + "=" + strings.Repeat("x", n-len(k)-1) }
	fits := strings.Repeat("a", MaxTraceState-2)
	for _, c := range []struct{ name, in, want string }{
		{"empty", "", ""},
		{"small kept whole", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7"},
		{"at the limit kept", "a=" + fits, "a=" + fits},
		// W3C: members over 128 characters go first ...
		{"long members dropped", long("big", 600) + ",k=v," + long("big2", 129), "k=v"},
		// ... then members from the end.
		{"cut from the end", strings.Repeat(long("m", 100)+",", 6), strings.TrimSuffix(strings.Repeat(long("m", 100)+",", 5), ",")},
		{"at most 32 members", strings.Repeat("k=v,", 200), strings.TrimSuffix(strings.Repeat("k=v,", 32), ",")},
	} {
		got := boundTraceState(c.in)
		require.Equal(t, c.want, got, c.name)
		require.LessOrEqual(t, len(got), MaxTraceState, c.name)
	}
}

// TestExtractKeepsOnlyTheSpanContext: baggage is never read; a tracestate
// over MaxTraceState is cut; ExtractTraceparent reads no tracestate at all.
func TestExtractKeepsOnlyTheSpanContext(t *testing.T) {
	t.Parallel()
	h := nats.Header{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		"tracestate": {"keep=1," + strings.Repeat("x", 2*MaxTraceState)}, "baggage": {"engine=e1"}}
	ctx := Extract(context.Background(), h)
	require.Zero(t, baggage.FromContext(ctx).Len())
	sc := trace.SpanContextFromContext(ctx)
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", sc.TraceID().String())
	require.Equal(t, "keep=1", sc.TraceState().String())

	ctx = ExtractTraceparent(context.Background(), h)
	require.Zero(t, baggage.FromContext(ctx).Len())
	sc = trace.SpanContextFromContext(ctx)
	require.True(t, sc.IsValid() && sc.IsRemote() && sc.IsSampled())
	require.Equal(t, "00f067aa0ba902b7", sc.SpanID().String())
	require.Zero(t, sc.TraceState().Len())
	require.False(t, trace.SpanContextFromContext(ExtractTraceparent(context.Background(), nil)).IsValid())
}

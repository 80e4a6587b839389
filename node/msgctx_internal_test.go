package node

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/internal/testkit"
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

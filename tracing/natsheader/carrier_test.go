package natsheader

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
)

// A ctx with a span writes a lowercase traceparent; one without writes
// nothing, not even an empty header (a message per lookup would carry it).
func TestInjectSpanWritesTheSpansContextOnly(t *testing.T) {
	m := &nats.Msg{}
	InjectSpan(context.Background(), m)
	require.Nil(t, m.Header)

	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2},
		TraceFlags: trace.FlagsSampled})
	m.Header = nats.Header{"Traceparent": {"stale"}}
	InjectSpan(trace.ContextWithSpanContext(context.Background(), sc), m)
	require.Equal(t, []string{"00-01000000000000000000000000000000-0200000000000000-01"}, m.Header["traceparent"])
	require.NotContains(t, m.Header, "Traceparent", "another spelling of the key is replaced")
}

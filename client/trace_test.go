package client_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestLookupAndLoadCarryTheTraceOfTheirContext: the node makes the
// engine's span the parent of its kvactors.lookup and kvactors.load spans
// from the request's traceparent (docs/OBSERVABILITY.md), so Lookup and
// Load write the trace context of their ctx into the request's headers;
// without a span in ctx they add none.
func TestLookupAndLoadCarryTheTraceOfTheirContext(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	lookups := make(chan *nats.Msg, 4)
	sub, err := nc.Subscribe("kvactors.e1.lookup", func(m *nats.Msg) {
		lookups <- m
		data, _ := json.Marshal(messages.LookupReply{HitTokens: 4, Node: "n1", Boot: "boot1"})
		_ = m.Respond(data)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
	loads := testkit.Subscribe(t, nc, "kvactors.e1.load") // the fake node answers them
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})

	ts, err := trace.ParseTraceState("vendor=x")
	require.NoError(t, err)
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5},
		TraceFlags: trace.FlagsSampled, TraceState: ts})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	const want = "00-01020300000000000000000000000000-0405000000000000-01"

	_, err = c.Lookup(ctx, []string{"aa"})
	require.NoError(t, err)
	m := testkit.Recv(t, lookups, 5*time.Second, "the lookup")
	require.Equal(t, want, m.Header.Get("traceparent"))
	require.Equal(t, "vendor=x", m.Header.Get("tracestate"))
	_, err = c.Load(ctx, "r", []string{"aa"}, 4, [][]int64{{9}})
	require.NoError(t, err)
	m = testkit.Recv(t, loads, 5*time.Second, "the load")
	require.Equal(t, want, m.Header.Get("traceparent"))
	require.Equal(t, "vendor=x", m.Header.Get("tracestate"))

	_, err = c.Lookup(context.Background(), []string{"aa"})
	require.NoError(t, err)
	require.Empty(t, testkit.Recv(t, lookups, 5*time.Second, "a lookup with no span").Header)
	_, err = c.Load(context.Background(), "r2", []string{"aa"}, 4, [][]int64{{9}})
	require.NoError(t, err)
	require.Empty(t, testkit.Recv(t, loads, 5*time.Second, "a load with no span").Header)
}

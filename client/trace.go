package client

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// withTrace writes the W3C trace context of ctx (traceparent, tracestate)
// into m's headers, so the node's span for the request (kvactors.lookup,
// kvactors.load) is a child of the engine's (PROTOCOL.md "Subjects"). A ctx
// with no span adds nothing. Batches have no ctx: Config.BeforePublish
// adds theirs.
func withTrace(ctx context.Context, m *nats.Msg) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	propagation.TraceContext{}.Inject(ctx, traceHeader(m.Header))
}

// traceHeader writes the lowercase keys W3C specifies (nats.Header, unlike
// http.Header, keeps a key as written).
type traceHeader nats.Header

func (h traceHeader) Get(key string) string {
	if v := h[strings.ToLower(key)]; len(v) > 0 {
		return v[0]
	}
	return ""
}

func (h traceHeader) Set(key, value string) { h[strings.ToLower(key)] = []string{value} }

func (h traceHeader) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}

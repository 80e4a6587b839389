package natsheader

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Carrier adapts a NATS message header to propagation.TextMapCarrier.
// nats.Header is a plain map with case-sensitive keys (unlike net/http), so
// the adapter writes the lowercase keys W3C specifies and reads them
// case-insensitively: an engine may well write "Traceparent".
type Carrier nats.Header

var _ propagation.TextMapCarrier = Carrier(nil)

// Get returns the first value of key: the exact key if present, else the
// first key that matches it case-insensitively.
func (c Carrier) Get(key string) string {
	if v := c[key]; len(v) > 0 {
		return v[0]
	}
	for k, v := range c {
		if len(v) > 0 && strings.EqualFold(k, key) {
			return v[0]
		}
	}
	return ""
}

// Set stores value under the lowercase key, replacing any value stored
// under another spelling of it, so that Get cannot find a stale one. c must
// not be nil.
func (c Carrier) Set(key, value string) {
	key = strings.ToLower(key)
	for k := range c {
		if k != key && strings.EqualFold(k, key) {
			delete(c, k)
		}
	}
	c[key] = []string{value}
}

// Keys lists the keys present, as spelled in the header.
func (c Carrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// InjectSpan writes the W3C trace context of ctx (traceparent, tracestate)
// into m's header, creating it if needed. A ctx with no valid span adds
// nothing, not even an empty header.
func InjectSpan(ctx context.Context, m *nats.Msg) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	propagation.TraceContext{}.Inject(ctx, Carrier(m.Header))
}

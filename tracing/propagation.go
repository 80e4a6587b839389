package tracing

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
)

// HeaderCarrier adapts a NATS message header to propagation.TextMapCarrier.
// nats.Header is a plain map with case-sensitive keys (unlike net/http), so
// the adapter writes the lowercase keys W3C specifies and reads them
// case-insensitively: an engine may well write "Traceparent".
type HeaderCarrier nats.Header

var _ propagation.TextMapCarrier = HeaderCarrier(nil)

// Get returns the first value of key: the exact key if present, else the
// first key that matches it case-insensitively.
func (c HeaderCarrier) Get(key string) string {
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
func (c HeaderCarrier) Set(key, value string) {
	key = strings.ToLower(key)
	for k := range c {
		if k != key && strings.EqualFold(k, key) {
			delete(c, k)
		}
	}
	c[key] = []string{value}
}

// Keys lists the keys present, as spelled in the header.
func (c HeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// propagator is immutable, so one value serves every call.
var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// Propagator returns the W3C TraceContext + Baggage propagator that kvactors
// uses on NATS headers (PROTOCOL.md: "NATS headers carry W3C
// traceparent/tracestate").
func Propagator() propagation.TextMapPropagator { return propagator }

// Inject writes the span context (and baggage) of ctx into h. h must not be
// nil; see InjectMsg for a message whose Header may be.
func Inject(ctx context.Context, h nats.Header) {
	propagator.Inject(ctx, HeaderCarrier(h))
}

// InjectMsg is Inject on m.Header, creating the header if m has none.
func InjectMsg(ctx context.Context, m *nats.Msg) {
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	Inject(ctx, m.Header)
}

// Extract returns ctx with the remote span context (and baggage) found in h,
// or ctx unchanged if h carries none. h may be nil.
func Extract(ctx context.Context, h nats.Header) context.Context {
	return propagator.Extract(ctx, HeaderCarrier(h))
}

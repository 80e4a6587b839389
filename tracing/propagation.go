package tracing

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/kvactors/kvactors/tracing/natsheader"
)

// HeaderCarrier adapts a NATS message header to
// propagation.TextMapCarrier, writing lowercase keys and reading any
// spelling (natsheader.Carrier, which the engine SDK shares).
type HeaderCarrier = natsheader.Carrier

// MaxTraceState is the most tracestate, in bytes, that Extract keeps from
// an inbound message. W3C trace-context ("Tracestate Limits") asks a
// tracer to propagate at least 512 characters; more than that is the
// engine's to hold, not the node's: a request's context lives until its
// release, so a 14.5 KB tracestate on every added request would pin ~17 KiB
// each, uncounted (docs/SECURITY.md "Bounds").
const MaxTraceState = 512

// maxTraceStateMembers is W3C's (and trace.ParseTraceState's) limit.
const maxTraceStateMembers = 32

// propagator is immutable, so one value serves every call. It is
// TraceContext alone: kvactors neither reads nor writes W3C baggage, which
// is arbitrary engine data (8 KB by the spec's limits) that nothing in the
// node uses, and which would otherwise be held per request and echoed on
// stored/released.
var propagator = propagation.TraceContext{}

// Propagator returns the W3C TraceContext propagator that kvactors uses on
// NATS headers (PROTOCOL.md: "NATS headers carry W3C
// traceparent/tracestate"). It propagates no baggage.
func Propagator() propagation.TextMapPropagator { return propagator }

// Inject writes the span context of ctx (traceparent and tracestate) into
// h. h must not be nil; see InjectMsg for a message whose Header may be.
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

// Extract returns ctx with the remote span context found in h (trace id,
// span id, flags and a tracestate cut to MaxTraceState bytes), or ctx
// unchanged if h carries none. Nothing else of h is kept: no baggage, and
// no string that shares memory with h. h may be nil.
func Extract(ctx context.Context, h nats.Header) context.Context {
	return propagator.Extract(ctx, boundedCarrier(h))
}

// ExtractTraceparent is Extract without the tracestate, for a node that
// records no spans: it only passes the engine's trace back to the same
// engine, which holds its own tracestate, so the tracestate is neither
// looked up nor parsed.
func ExtractTraceparent(ctx context.Context, h nats.Header) context.Context {
	return propagator.Extract(ctx, parentOnlyCarrier(h))
}

// boundedCarrier and parentOnlyCarrier are read-only views of a header for
// TraceContext.Extract, so the parse is OTel's own but sees only what
// kvactors keeps. Map types: passing one as an interface allocates nothing.
type (
	boundedCarrier    nats.Header
	parentOnlyCarrier nats.Header
)

func (c boundedCarrier) Get(key string) string {
	v := HeaderCarrier(c).Get(key)
	if strings.EqualFold(key, "tracestate") {
		return boundTraceState(v)
	}
	return v
}

func (boundedCarrier) Set(string, string) {}

func (c boundedCarrier) Keys() []string { return HeaderCarrier(c).Keys() }

func (c parentOnlyCarrier) Get(key string) string {
	if !strings.EqualFold(key, "traceparent") {
		return ""
	}
	return HeaderCarrier(c).Get(key)
}

func (parentOnlyCarrier) Set(string, string) {}

func (c parentOnlyCarrier) Keys() []string { return []string{"traceparent"} }

// boundTraceState returns ts if it fits MaxTraceState, else ts cut as W3C
// trace-context "Tracestate Limits" says: members over 128 characters
// first, then members from the end. The result never shares memory with
// ts: nats.go's header values are substrings of the message's whole header
// block, so keeping ts itself would pin the block (baggage and all).
func boundTraceState(ts string) string {
	if ts == "" {
		return ""
	}
	if len(ts) <= MaxTraceState {
		return strings.Clone(ts)
	}
	var b strings.Builder
	members := 0
	for rest := ts; rest != "" && members < maxTraceStateMembers; {
		var m string
		m, rest, _ = strings.Cut(rest, ",")
		m = strings.Trim(m, " \t")
		if m == "" || len(m) > 128 {
			continue
		}
		n := len(m)
		if b.Len() > 0 {
			n++
		}
		if b.Len()+n > MaxTraceState {
			break
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(m)
		members++
	}
	return b.String()
}

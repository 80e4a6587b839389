package tracing

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

const benchParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// hostileHeader is what an engine may send on every message: an 8 KB
// baggage of 64 members and a 14.5 KB tracestate of 32 entries.
func hostileHeader() nats.Header {
	bag := make([]string, 64)
	for i := range bag {
		bag[i] = fmt.Sprintf("k%02d=%s", i, strings.Repeat("v", 120))
	}
	ts := make([]string, 32)
	for i := range ts {
		ts[i] = fmt.Sprintf("v%02d%s=%s", i, strings.Repeat("k", 200), strings.Repeat("s", 250)) // valid for OTel
	}
	return nats.Header{"traceparent": {benchParent}, "tracestate": {strings.Join(ts, ",")},
		"baggage": {strings.Join(bag, ",")}}
}

var benchHeaders = []struct {
	name string
	h    nats.Header
}{
	{"none", nats.Header{"Nats-Msg-Id": {"x"}}},
	{"traceparent", nats.Header{"traceparent": {benchParent}}},
	{"small_state", nats.Header{"traceparent": {benchParent}, "tracestate": {"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"}}},
	{"hostile", hostileHeader()},
}

// BenchmarkExtract is the per-message cost of msgCtx's extraction (one per
// inbound NATS message) with tracing on.
func BenchmarkExtract(b *testing.B) {
	for _, c := range benchHeaders {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = Extract(context.Background(), c.h)
			}
		})
	}
}

// BenchmarkExtractTraceparent is the same with tracing off.
func BenchmarkExtractTraceparent(b *testing.B) {
	for _, c := range benchHeaders {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = ExtractTraceparent(context.Background(), c.h)
			}
		})
	}
}

// Package tracing is kvactors' OpenTelemetry plumbing: one naming scheme for
// spans, span events and attributes (names.go), the TracerProvider set-up
// from the standard OTEL_* environment (Init), and W3C trace-context
// propagation through NATS headers (HeaderCarrier, Inject, Extract).
//
// Nothing here reads or writes OTel globals, except SetGlobal, which only
// cmd/ or node/ may call: every component takes its trace.TracerProvider as
// a dependency, so tests can pass a tracetest recorder and run in parallel
// (STYLE.md "Avoid: otel.Set* calls in library code or tests").
//
// The default is no tracing at all (OTEL_TRACES_EXPORTER unset or "none"):
// Init then returns the trace/noop provider, whose spans cost next to nothing
// on the event hot path.
package tracing

package tracing

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/ratelog"
)

// Exporter names, as in OTEL_TRACES_EXPORTER.
const (
	ExporterNone    = "none"
	ExporterOTLP    = "otlp"
	ExporterConsole = "console"
)

// DefaultServiceName is service.name unless OTEL_SERVICE_NAME or
// Options.ServiceName says otherwise.
const DefaultServiceName = "kvactors"

// The environment variables Init itself reads. Everything else (endpoint,
// headers, TLS, timeouts, sampler, resource attributes) is read by the SDK
// and the exporters, which know the precedence rules.
const (
	envExporter       = "OTEL_TRACES_EXPORTER"
	envProtocol       = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envSDKDisabled    = "OTEL_SDK_DISABLED"
)

// ErrConfig: the exporter or protocol setting is not one Init supports.
var ErrConfig = errors.New("tracing: bad configuration")

// Options override what the environment says. The zero value means "all
// from the environment".
type Options struct {
	// Exporter overrides OTEL_TRACES_EXPORTER: a comma-separated list of
	// "otlp", "console" and "none". Unset in both places means "none".
	Exporter string
	// Writer is where the console exporter writes, one JSON object per
	// span (e.g. the demo's --trace-file). Default os.Stdout.
	Writer io.Writer
	// ServiceName overrides OTEL_SERVICE_NAME (default "kvactors").
	ServiceName string
	// ShutdownTimeout bounds the returned shutdown (0: DefaultShutdownTimeout)
	// whatever its context: with the collector unreachable, flushing the
	// queued spans waits out the exporter's own timeout per batch (40 s for
	// a full queue), and a process stopping must not.
	ShutdownTimeout time.Duration
}

// DefaultShutdownTimeout is Options.ShutdownTimeout's default.
const DefaultShutdownTimeout = 5 * time.Second

// Init builds a TracerProvider from opts and the standard environment:
//
//   - OTEL_TRACES_EXPORTER picks the exporters (default "none", which
//     returns the trace/noop provider; so does OTEL_SDK_DISABLED=true).
//   - For otlp, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
//     OTEL_EXPORTER_OTLP_PROTOCOL, picks "grpc" (kvactors' default) or
//     "http/protobuf"; the chosen exporter reads the endpoint, headers and
//     TLS variables itself.
//   - OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES feed the resource.
//   - OTEL_TRACES_SAMPLER(_ARG) are read by the SDK; unset, the sampler is
//     parentbased_always_on, so an engine's sampling decision is kept.
//
// Every exporter sits behind a batch span processor, so ending a span never
// waits for I/O. The returned shutdown flushes and stops them; call it
// before exit. Init touches no OTel global (see SetGlobal).
func Init(ctx context.Context, opts Options) (trace.TracerProvider, func(context.Context) error, error) {
	noShutdown := func(context.Context) error { return nil }
	names := opts.Exporter
	if names == "" {
		names = os.Getenv(envExporter)
	}
	if strings.EqualFold(strings.TrimSpace(os.Getenv(envSDKDisabled)), "true") {
		names = ExporterNone
	}
	var exporters []sdktrace.SpanExporter
	shutdownAll := func() {
		for _, e := range exporters {
			_ = e.Shutdown(ctx) // set-up failed: the error that matters is the one returned
		}
	}
	for name := range strings.SplitSeq(names, ",") {
		exp, err := newExporter(ctx, strings.ToLower(strings.TrimSpace(name)), opts)
		if err != nil {
			shutdownAll()
			return nil, nil, err
		}
		if exp != nil {
			exporters = append(exporters, exp)
		}
	}
	if len(exporters) == 0 {
		return noop.NewTracerProvider(), noShutdown, nil
	}
	if err := checkSampler(); err != nil {
		shutdownAll()
		return nil, nil, err
	}
	res, err := newResource(ctx, opts.ServiceName)
	if err != nil {
		shutdownAll()
		return nil, nil, err
	}
	tpOpts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	for _, e := range exporters {
		tpOpts = append(tpOpts, sdktrace.WithBatcher(e))
	}
	// No WithSampler: the SDK then reads OTEL_TRACES_SAMPLER and otherwise
	// defaults to ParentBased(AlwaysSample).
	tp := sdktrace.NewTracerProvider(tpOpts...)
	bound := opts.ShutdownTimeout
	if bound <= 0 {
		bound = DefaultShutdownTimeout
	}
	return tp, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, bound)
		defer cancel()
		return tp.Shutdown(ctx) // spans still queued at the deadline are lost
	}, nil
}

// checkSampler refuses an OTEL_TRACES_SAMPLER the SDK does not know, or a
// ratio sampler's OTEL_TRACES_SAMPLER_ARG that is not a number in [0, 1]:
// the SDK would print a line and fall back to its default, sampling
// what the operator meant to sample otherwise.
func checkSampler() error {
	name := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER")))
	switch name {
	case "", "always_on", "always_off", "parentbased_always_on", "parentbased_always_off":
		return nil
	case "traceidratio", "parentbased_traceidratio":
		arg := strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER_ARG"))
		if arg == "" {
			return nil // the SDK's 1.0
		}
		if r, err := strconv.ParseFloat(arg, 64); err != nil || r < 0 || r > 1 {
			return fmt.Errorf("%w: OTEL_TRACES_SAMPLER_ARG %q: want a ratio in [0, 1]", ErrConfig, arg)
		}
		return nil
	}
	return fmt.Errorf("%w: OTEL_TRACES_SAMPLER %q: want always_on, always_off, traceidratio or their parentbased_ forms",
		ErrConfig, name)
}

// newExporter returns the exporter for one OTEL_TRACES_EXPORTER entry, or
// nil for "none" and the empty string.
func newExporter(ctx context.Context, name string, opts Options) (sdktrace.SpanExporter, error) {
	switch name {
	case "", ExporterNone:
		return nil, nil
	case ExporterConsole:
		w := opts.Writer
		if w == nil {
			w = os.Stdout
		}
		exp, err := stdouttrace.New(stdouttrace.WithWriter(w))
		if err != nil {
			return nil, fmt.Errorf("tracing: console exporter: %w", err)
		}
		return exp, nil
	case ExporterOTLP:
		proto := os.Getenv(envTracesProtocol)
		if proto == "" {
			proto = os.Getenv(envProtocol)
		}
		var (
			exp sdktrace.SpanExporter
			err error
		)
		switch strings.TrimSpace(proto) {
		case "", "grpc":
			exp, err = otlptracegrpc.New(ctx)
		case "http/protobuf":
			exp, err = otlptracehttp.New(ctx)
		default:
			return nil, fmt.Errorf("%w: OTLP protocol %q, want grpc or http/protobuf", ErrConfig, proto)
		}
		if err != nil {
			return nil, fmt.Errorf("tracing: otlp exporter (%s): %w", proto, err)
		}
		return exp, nil
	}
	return nil, fmt.Errorf("%w: traces exporter %q, want otlp, console or none", ErrConfig, name)
}

// newResource describes this process: service.name is "kvactors", then
// whatever OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES say, then
// Options.ServiceName (later detectors win when resource.New merges them).
func newResource(ctx context.Context, serviceName string) (*resource.Resource, error) {
	ropts := []resource.Option{
		resource.WithSchemaURL(semconv.SchemaURL),
		resource.WithAttributes(semconv.ServiceName(DefaultServiceName)),
		resource.WithFromEnv(),
		resource.WithTelemetrySDK(),
	}
	if serviceName != "" {
		ropts = append(ropts, resource.WithAttributes(semconv.ServiceName(serviceName)))
	}
	res, err := resource.New(ctx, ropts...)
	if err != nil {
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	return res, nil
}

// SetGlobal installs tp and Propagator() as the OTel globals, for libraries
// that only know the globals. Only cmd/ or node/ may call it, once, at
// start-up; everything in kvactors takes its provider as a dependency.
func SetGlobal(tp trace.TracerProvider) {
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(Propagator())
}

// LogErrors sends the OTel SDK's errors (a failed export, say: an
// unreachable collector fails every batch) to log at Warn, a few lines a
// minute (ratelog), instead of the standard logger's plain lines on
// stderr, which ignore --log-format. OTel has one handler per process.
func LogErrors(log *slog.Logger) {
	lim := ratelog.NewLog(log, nil)
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		lim.Log(slog.LevelWarn, "otel", "tracing: the OpenTelemetry SDK failed", "err", err)
	}))
}

package tracing

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// clearEnv unsets the variables Init and the SDK read, so the developer's
// shell cannot change the outcome. (t.Setenv forbids t.Parallel, which is
// fine: these tests are fast.)
func clearEnv(t *testing.T) {
	for _, k := range []string{envExporter, envProtocol, envTracesProtocol, envSDKDisabled,
		"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"} {
		t.Setenv(k, "")
	}
}

func shutdown(t *testing.T, f func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, f(ctx))
}

func TestInitDefaultsToNoop(t *testing.T) {
	clearEnv(t)
	tp, stop, err := Init(context.Background(), Options{})
	require.NoError(t, err)
	require.IsType(t, noop.TracerProvider{}, tp)
	_, span := Tracer(tp).Start(context.Background(), SpanBatch)
	require.False(t, span.IsRecording())
	span.End()
	shutdown(t, stop)
}

func TestInitNoneAndSDKDisabledAreNoop(t *testing.T) {
	clearEnv(t)
	t.Setenv(envExporter, "none")
	tp, stop, err := Init(context.Background(), Options{})
	require.NoError(t, err)
	require.IsType(t, noop.TracerProvider{}, tp)
	shutdown(t, stop)

	t.Setenv(envSDKDisabled, "true")
	tp, stop, err = Init(context.Background(), Options{Exporter: ExporterConsole, Writer: &bytes.Buffer{}})
	require.NoError(t, err)
	require.IsType(t, noop.TracerProvider{}, tp)
	shutdown(t, stop)
}

// consoleSpans decodes the console exporter's output: one JSON object per span.
func consoleSpans(t *testing.T, out []byte) []map[string]any {
	t.Helper()
	var spans []map[string]any
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var s map[string]any
		require.NoError(t, dec.Decode(&s))
		spans = append(spans, s)
	}
	return spans
}

func serviceName(t *testing.T, span map[string]any) string {
	t.Helper()
	for _, a := range span["Resource"].([]any) {
		if kv := a.(map[string]any); kv["Key"] == "service.name" {
			return kv["Value"].(map[string]any)["Value"].(string)
		}
	}
	t.Fatal("no service.name in the resource")
	return ""
}

func TestInitConsoleWritesSpansOnShutdown(t *testing.T) {
	clearEnv(t)
	var buf bytes.Buffer
	tp, stop, err := Init(context.Background(), Options{Exporter: ExporterConsole, Writer: &buf})
	require.NoError(t, err)
	_, span := Tracer(tp).Start(context.Background(), SpanBatch, trace.WithAttributes(AttrEngine.String("e1")))
	require.True(t, span.IsRecording(), "the default sampler samples a root span")
	span.End()
	shutdown(t, stop) // flushes the batcher; only then is buf safe to read

	spans := consoleSpans(t, buf.Bytes())
	require.Len(t, spans, 1)
	require.Equal(t, SpanBatch, spans[0]["Name"])
	require.Equal(t, DefaultServiceName, serviceName(t, spans[0]))
	require.Equal(t, TracerName, spans[0]["InstrumentationScope"].(map[string]any)["Name"])
}

func TestInitReadsExporterAndServiceNameFromEnv(t *testing.T) {
	clearEnv(t)
	t.Setenv(envExporter, "console")
	t.Setenv("OTEL_SERVICE_NAME", "from-env")
	var buf bytes.Buffer
	tp, stop, err := Init(context.Background(), Options{Writer: &buf})
	require.NoError(t, err)
	_, span := Tracer(tp).Start(context.Background(), SpanLookup)
	span.End()
	shutdown(t, stop)
	spans := consoleSpans(t, buf.Bytes())
	require.Len(t, spans, 1)
	require.Equal(t, "from-env", serviceName(t, spans[0]))
}

func TestInitOptionsOverrideEnv(t *testing.T) {
	clearEnv(t)
	t.Setenv(envExporter, "otlp")
	t.Setenv("OTEL_SERVICE_NAME", "from-env")
	var buf bytes.Buffer
	tp, stop, err := Init(context.Background(), Options{Exporter: "console", Writer: &buf, ServiceName: "from-opts"})
	require.NoError(t, err)
	_, span := Tracer(tp).Start(context.Background(), SpanLoad)
	span.End()
	shutdown(t, stop)
	spans := consoleSpans(t, buf.Bytes())
	require.Len(t, spans, 1)
	require.Equal(t, "from-opts", serviceName(t, spans[0]))
}

// TestInitDefaultSamplerIsParentBasedAlwaysOn: with OTEL_TRACES_SAMPLER
// unset, a root span is sampled and a child follows its remote parent's
// decision, so an engine that does not sample a batch costs kvactors nothing.
func TestInitDefaultSamplerIsParentBasedAlwaysOn(t *testing.T) {
	clearEnv(t)
	tp, stop, err := Init(context.Background(), Options{Exporter: ExporterConsole, Writer: &bytes.Buffer{}})
	require.NoError(t, err)
	defer shutdown(t, stop)
	tr := Tracer(tp)

	_, root := tr.Start(context.Background(), SpanBatch)
	require.True(t, root.SpanContext().IsSampled())
	root.End()

	for _, sampled := range []bool{true, false} {
		flags := "00"
		if sampled {
			flags = "01"
		}
		ctx := Extract(context.Background(), map[string][]string{
			"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-" + flags}})
		_, child := tr.Start(ctx, SpanBatch)
		require.Equal(t, sampled, child.SpanContext().IsSampled(), "parent sampled=%v", sampled)
		child.End()
	}
}

func TestInitHonoursSamplerEnv(t *testing.T) {
	clearEnv(t)
	t.Setenv("OTEL_TRACES_SAMPLER", "always_off")
	tp, stop, err := Init(context.Background(), Options{Exporter: ExporterConsole, Writer: &bytes.Buffer{}})
	require.NoError(t, err)
	defer shutdown(t, stop)
	_, span := Tracer(tp).Start(context.Background(), SpanBatch)
	require.False(t, span.SpanContext().IsSampled())
}

// TestInitOTLPPicksProtocol: both OTLP exporters build without a collector
// (they connect lazily); an unsupported protocol is a configuration error.
func TestInitOTLPPicksProtocol(t *testing.T) {
	for _, tc := range []struct{ env, proto string }{
		{envProtocol, ""},
		{envProtocol, "grpc"},
		{envProtocol, "http/protobuf"},
		{envTracesProtocol, "http/protobuf"},
	} {
		t.Run(tc.env+"="+tc.proto, func(t *testing.T) {
			clearEnv(t)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
			t.Setenv(tc.env, tc.proto)
			tp, stop, err := Init(context.Background(), Options{Exporter: ExporterOTLP})
			require.NoError(t, err)
			require.NotNil(t, tp)
			shutdown(t, stop) // no spans: nothing to send
		})
	}
	clearEnv(t)
	t.Setenv(envProtocol, "grpc") // the traces-specific variable wins
	t.Setenv(envTracesProtocol, "http/json")
	_, _, err := Init(context.Background(), Options{Exporter: ExporterOTLP})
	require.ErrorIs(t, err, ErrConfig)
}

func TestInitRejectsUnknownExporter(t *testing.T) {
	clearEnv(t)
	_, _, err := Init(context.Background(), Options{Exporter: "zipkin"})
	require.ErrorIs(t, err, ErrConfig)
	_, _, err = Init(context.Background(), Options{Exporter: "console,zipkin", Writer: &bytes.Buffer{}})
	require.ErrorIs(t, err, ErrConfig)
}

func TestInitExporterList(t *testing.T) {
	clearEnv(t)
	var buf bytes.Buffer
	tp, stop, err := Init(context.Background(), Options{Exporter: " Console , none", Writer: &buf})
	require.NoError(t, err)
	_, span := Tracer(tp).Start(context.Background(), SpanCopy)
	span.End()
	shutdown(t, stop)
	require.True(t, strings.Contains(buf.String(), SpanCopy))
}

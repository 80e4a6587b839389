package tracing

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
)

// serve shuts tracing down with context.Background() once the node has
// closed. With the OTLP collector unreachable and a queue of spans, the
// SDK alone waited out the exporter's timeout per batch (40 s for a full
// queue) before the process could exit; Init's shutdown is bounded.
func TestShutdownWithAnUnreachableCollectorIsBounded(t *testing.T) {
	clearEnv(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now: connections are refused
	t.Setenv(envExporter, ExporterOTLP)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+addr)
	t.Setenv(envProtocol, "grpc")
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(error) {})) // the SDK's export errors: expected here
	t.Cleanup(func() { otel.SetErrorHandler(otel.ErrorHandlerFunc(func(error) {})) })
	const bound = 300 * time.Millisecond
	tp, shutdown, err := Init(context.Background(), Options{ShutdownTimeout: bound})
	require.NoError(t, err)
	tr := tp.Tracer("t")
	for range 2048 {
		_, s := tr.Start(context.Background(), "x")
		s.End()
	}
	start := time.Now()
	err = shutdown(context.Background()) // as serve does
	took := time.Since(start)
	require.ErrorIs(t, err, context.DeadlineExceeded, "the spans could not be flushed")
	require.Less(t, took, bound+2*time.Second, "shutdown took %v", took)
}

// The SDK's errors go to the node's logger, rate limited, not to the
// standard logger's stderr lines.
func TestLogErrorsSendsTheSDKsErrorsToTheLogger(t *testing.T) {
	var buf bytes.Buffer
	LogErrors(slog.New(slog.NewJSONHandler(&buf, nil)))
	t.Cleanup(func() { otel.SetErrorHandler(otel.ErrorHandlerFunc(func(error) {})) })
	for range 100 {
		otel.Handle(errors.New("traces export: connection refused"))
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.NotEmpty(t, lines)
	require.Less(t, len(lines), 20, "rate limited: %d lines", len(lines))
	require.Contains(t, lines[0], `"level":"WARN"`)
	require.Contains(t, lines[0], "connection refused")
}

package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/tracing"
)

// TestJaegerEndToEnd exports a lagging, pool-full scenario over OTLP to a
// real Jaeger and reads the trace back from Jaeger's HTTP API. It runs only
// under scripts/e2e-jaeger, which builds and starts Jaeger and sets
// KVACTORS_JAEGER_QUERY (and the standard OTEL_* variables).
func TestJaegerEndToEnd(t *testing.T) {
	query := os.Getenv("KVACTORS_JAEGER_QUERY")
	if query == "" {
		t.Skip("KVACTORS_JAEGER_QUERY not set: run scripts/e2e-jaeger")
	}
	service := fmt.Sprintf("kvactors-e2e-%d", time.Now().UnixNano())
	tp, shutdown, err := tracing.Init(context.Background(), tracing.Options{Exporter: "otlp", ServiceName: service})
	require.NoError(t, err)
	e := startNode(t, func(c *node.Config) { c.Tracer = tp; c.PoolBytes = 2 * 256 })
	te := e.newEngine("jaeger", defaultOpts())
	te.register()
	hs := []string{hash("j", 0), hash("j", 1), hash("j", 2)}
	// Hashes lag: chunk 0 stored, chunks 1, 2 deferred (hashes).
	te.send(added("r", 12), hashesEv("r", 0, hs[0]), blocksEv("r", 0, 0, 1, 2, 3), tokensEv("r", 12, 12))
	recv(t, te.stored, "chunk 0")
	// Both hashes arrive: two chunks, one free slot and one evictable (chunk
	// 0 is not offered): stored. Then a second request offers three chunks
	// to a two-slot pool: pool_full retries, until preempted and resumed
	// with two blocks.
	te.send(hashesEv("r", 1, hs[1], hs[2]))
	recv(t, te.stored, "chunks 1, 2")
	te.send(finishedEv("r", false, 12, 12))
	recv(t, te.released, "released r")
	ks := []string{hash("k", 0), hash("k", 1), hash("k", 2)}
	te.send(added("s", 12), hashesEv("s", 0, ks...), blocksEv("s", 0, 0, 4, 5, 6), tokensEv("s", 12, 12))
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if metricValue(t, e.reg, "kvactors_store_retries_total", nil) < 2 {
			return errf("no retries yet")
		}
		return nil
	})
	te.send(map[string]any{"type": "preempted", "request": "s"})
	recv(t, te.released, "released s (preempted)")
	te.send(map[string]any{"type": "resumed", "request": "s"}, blocksEv("s", 0, 0, 7, 8), finishedEv("s", false, 8, 12))
	recv(t, te.stored, "chunks of s")
	recv(t, te.released, "released s")
	require.NoError(t, e.node.Close(context.Background()))
	require.NoError(t, shutdown(context.Background()))

	testkit.Eventually(t, 60*time.Second, 500*time.Millisecond, func() error {
		resp, err := http.Get(strings.TrimRight(query, "/") + "/api/traces?service=" + service + "&limit=50")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var body struct {
			Data []struct {
				Spans []struct {
					OperationName string `json:"operationName"`
					Logs          []struct {
						Fields []struct {
							Key   string `json:"key"`
							Value any    `json:"value"`
						} `json:"fields"`
					} `json:"logs"`
				} `json:"spans"`
			} `json:"data"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			return fmt.Errorf("decode jaeger answer: %w", err)
		}
		seen := map[string]bool{}
		for _, tr := range body.Data {
			for _, sp := range tr.Spans {
				seen[sp.OperationName] = true
				for _, l := range sp.Logs {
					for _, f := range l.Fields {
						if f.Key == "event" {
							seen[fmt.Sprint(f.Value)] = true
						}
					}
				}
			}
		}
		for _, want := range []string{tracing.SpanRequest, tracing.SpanStoreJob, tracing.SpanCopy,
			tracing.EventDeferred, tracing.EventRetry} {
			if !seen[want] {
				return fmt.Errorf("jaeger has no %q yet (seen %v)", want, seen)
			}
		}
		return nil
	})
	t.Logf("trace found: open %s/search?service=%s", query, service)
}

package request_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/tracing"
)

// recordSpans makes deps trace into a recorder (passed in: no global
// provider is touched).
func recordSpans(deps *request.Deps) *tracetest.SpanRecorder {
	rec := tracetest.NewSpanRecorder()
	deps.Tracer = tracing.Tracer(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	return rec
}

// requestSpan is the one ended request span rec holds.
func requestSpan(t *testing.T, rec *tracetest.SpanRecorder) sdktrace.ReadOnlySpan {
	t.Helper()
	var found []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == tracing.SpanRequest {
			found = append(found, s)
		}
	}
	require.Len(t, found, 1, "ended request spans")
	return found[0]
}

// eventAttrs are the attributes of each of span's events named name.
func eventAttrs(span sdktrace.ReadOnlySpan, name string) []map[string]any {
	var out []map[string]any
	for _, ev := range span.Events() {
		if ev.Name != name {
			continue
		}
		m := map[string]any{}
		for _, kv := range ev.Attributes {
			m[string(kv.Key)] = kv.Value.AsInterface()
		}
		out = append(out, m)
	}
	return out
}

// finishIntoARefusingPool spawns r with one chunk ready against a pool that
// refuses room, finishes it, and sends batches until it gives the chunk up
// (each batch's decision fails: FinishRetryLimit+1 of them give up). It
// returns once r is released.
func finishIntoARefusingPool(t *testing.T, nc *nats.Conn, rig heldRig, deps *request.Deps) {
	t.Helper()
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	gs := &gatedStore{Store: deps.Store, gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	gs.refuse.Store(true)
	deps.Store = gs
	pid := request.NewSpawner().Spawn(rig.system.Root, deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0"}},
		{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r", Computed: 4, Total: 4},
		{Type: messages.EvFinished, Request: "r", Computed: 4, Total: 4}}})
	for range sched.FinishRetryLimit {
		rig.system.Root.Send(pid, &request.Events{}) // a batch with nothing for r but a decision
	}
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 10*time.Second, "r released").Data, &rel))
	require.Equal(t, "finished", rel.Reason)
}

// A finishing request that gives its ready chunks up (the pool kept
// refusing room) says so on its span, not only in
// kvactors_store_chunks_dropped_total: a `dropped` event with the chunks
// and the failure's reason, before `released` (OBSERVABILITY.md).
func TestAGiveUpIsASpanEvent(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	deps := rig.deps
	rec := recordSpans(&deps)
	finishIntoARefusingPool(t, nc, rig, &deps)

	require.Equal(t, 1.0, testutil.ToFloat64(rig.store.ChunksDropped))
	span := requestSpan(t, rec)
	require.Equal(t, []map[string]any{{string(tracing.AttrChunks): int64(1), string(tracing.AttrReason): "pool_full"}},
		eventAttrs(span, tracing.EventDropped))
	evs := span.Events()
	require.Equal(t, "released", evs[len(evs)-1].Name)
	require.Equal(t, tracing.EventDropped, evs[len(evs)-2].Name, "dropped, then released")
}

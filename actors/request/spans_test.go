package request_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/hostpool"
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

// requestSpan waits for the request span to end (just after its release
// is published) and returns it.
func requestSpan(t *testing.T, rec *tracetest.SpanRecorder) sdktrace.ReadOnlySpan {
	t.Helper()
	var found []sdktrace.ReadOnlySpan
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		found = found[:0]
		for _, s := range rec.Ended() {
			if s.Name() == tracing.SpanRequest {
				found = append(found, s)
			}
		}
		if len(found) != 1 {
			return fmt.Errorf("%d request spans ended, want 1", len(found))
		}
		return nil
	})
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

// kvactors_store_retries_total and the `retry` event count retries armed,
// not failed decisions: batches for a request whose retry is armed (the
// pool still full) schedule nothing and add neither; an early wake-up that
// fails again re-arms on the timer already running, so its `retry` carries
// no backoff of its own (OBSERVABILITY.md). The timers are
// stopped: no retry falls due on its own during the test.
func TestRetriesCountRetriesArmed(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	deps := rig.deps
	rec := recordSpans(&deps)
	deps.Timers.Stop()
	gs := &gatedStore{Store: deps.Store, gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	gs.refuse.Store(true)
	deps.Store = gs
	pid := request.NewSpawner().Spawn(rig.system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0"}},
		{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r", Computed: 4, Total: 4}}})
	for range 5 {
		rig.system.Root.Send(pid, &request.Events{}) // each decision fails; the first retry is still armed
	}
	rig.system.Root.Send(pid, request.WokenRetryDueFor(1, 1)) // room may have freed: it has not
	rig.system.Root.Send(pid, &request.Reset{Reason: messages.ReasonEngineReset})
	testkit.Recv(t, released, 5*time.Second, "r released")

	span := requestSpan(t, rec)
	attempt, backoff := string(tracing.AttrAttempt), string(tracing.AttrBackoffMS)
	reason := string(tracing.AttrReason)
	require.Equal(t, []map[string]any{
		{reason: "pool_full", attempt: int64(1), backoff: int64(10)}, // armed, its timer started
		// The wake-up's retry, on that timer. The batches' failures armed
		// nothing, yet they are attempts (towards FinishRetryLimit): 1+5.
		{reason: "pool_full", attempt: int64(6)},
	}, eventAttrs(span, tracing.EventRetry))
	require.Equal(t, 2.0, testutil.ToFloat64(rig.store.Retries.WithLabelValues("pool_full")),
		"kvactors_store_retries_total{reason=pool_full}")
}

// panicOnSecond is a store whose second decision panics: a bug that fails
// the request actor with its first job still in flight.
type panicOnSecond struct {
	request.Store
	calls atomic.Int32
}

func (s *panicOnSecond) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if s.calls.Add(1) == 2 {
		panic("injected: a bug in a store decision")
	}
	return s.Store.PrepareStoreInto(out, keys, sizes)
}

// A request actor that stops, or fails and is restarted, with a store job
// in flight ends that job's span too, with an error status saying why (no
// JobDone will come to end it): every span it started ends.
func TestJobSpansEndWhenTheRequestActorEnds(t *testing.T) {
	for _, how := range []string{"stopped", "restarted"} {
		t.Run(how, func(t *testing.T) {
			_, nc := testkit.NATS(t)
			rig := newHeldRig(t, nc, 16)
			deps := rig.deps
			rec := recordSpans(&deps)
			deps.Store = &panicOnSecond{Store: deps.Store}
			pid := request.NewSpawner().Spawn(rig.system.Root, &deps, &messages.Event{Type: messages.EvAdded,
				Request: "r", PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
			rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
				{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0"}},
				{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1}},
				{Type: messages.EvTokens, Request: "r", Computed: 4, Total: 8}}})
			testkit.Recv(t, rig.seen, 5*time.Second, "the store job, held in flight")
			if how == "stopped" {
				require.NoError(t, rig.system.Root.StopFuture(pid).Wait())
			} else {
				rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
					{Type: messages.EvHashes, Request: "r", Start: 1, Hashes: []messages.Hash{"h1"}},
					{Type: messages.EvBlocks, Request: "r", Start: 1, IDs: []messages.BlockID{2}},
					{Type: messages.EvTokens, Request: "r", Computed: 8, Total: 8}}})
			}
			testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
				if started, ended := len(rec.Started()), len(rec.Ended()); started != 2 || ended != started {
					return fmt.Errorf("%d spans started, %d ended; want 2 and 2", started, ended)
				}
				return nil
			})
			for _, s := range rec.Ended() {
				require.Equal(t, codes.Error, s.Status().Code, "%s: ended by the actor's end", s.Name())
				if s.Name() == tracing.SpanStoreJob {
					require.Contains(t, s.Status().Description, "stopped before the job ended")
				}
			}
		})
	}
}

package engine_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
	"github.com/kvactors/kvactors/tracing"
)

// jobSpanPanics is a tracer whose store job span panics once armed: a
// failure after a decision reserved its job's room in the pool and before
// the job reached the copy queue.
type jobSpanPanics struct {
	noop.Tracer
	arm atomic.Bool
}

func (p *jobSpanPanics) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if name == tracing.SpanStoreJob && p.arm.CompareAndSwap(true, false) {
		panic("request actor failure injected between its decision and the copy queue")
	}
	return p.Tracer.Start(ctx, name, opts...)
}

// A request actor that fails after its decision reserved a chunk's room
// (pending in the pool) and before the job reached the copy queue frees
// that room as it stops: the engine's Drain cancels only queued copies, so
// the key would otherwise stay pending for good, and every later request
// offering it would hold it back (a ready chunk never stored). Here r
// fails so, is released aborted, and s, offering the same chunk, stores
// it.
func TestAFailedRequestFreesTheRoomItsUnsubmittedJobReserved(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	stored := testkit.Subscribe(t, nc, "kvactors.e1.stored")
	tracer := &jobSpanPanics{}
	var st *store.Store
	system, pid, m, _ := startEngineWith(t, nc, make(chan struct{}), func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		st = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil))
		d.Store = st.Engine("e1", lay, testkit.NopDevice{})
		d.Tracer = tracer
		oneWorkerTransfer(system, d)
	})

	tracer.arm.Store(true)
	sendBatch(system, pid, 1, append([]messages.Event{added("r")}, chunk("r", 0)...)...)
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted},
		recvRelease(t, released, "r's release after its failure"))
	require.Equal(t, 1.0, testutilValue(m), "r's actor failed")
	require.False(t, tracer.arm.Load(), "the failure was injected at r's job span")
	require.Zero(t, st.Stats().Pending, "r's reserved room is still pending after r's release")

	// r's failure resynced epoch a: s comes in the next one, offering r's
	// chunk (its hash) over a block of its own.
	epochSender(system, pid)("b", 1, added("s"),
		messages.Event{Type: messages.EvHashes, Request: "s", Hashes: []messages.Hash{"h-r0"}},
		messages.Event{Type: messages.EvBlocks, Request: "s", IDs: []messages.BlockID{7}},
		tokens("s", 4))
	var got messages.Stored
	require.NoError(t, json.Unmarshal(testkit.Recv(t, stored, 5*time.Second, "s's stored").Data, &got))
	require.Equal(t, "s", got.Request)
	require.Len(t, got.Chunks, 1, "s stored the chunk r's failed decision had reserved")
	require.Equal(t, 1, st.Stats().Ready)
	require.Zero(t, st.Stats().Pending)
}

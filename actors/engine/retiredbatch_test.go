package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// A batch queued to an engine actor that is retiring (its request's copy
// still in flight keeps it alive) is not applied, and is counted once as
// rejected unknown_engine, as ingest counts a batch for an engine it has
// no actor for; it is not a received batch (PROTOCOL.md, rejections).
func TestABatchForARetiringEngineIsRejected(t *testing.T) {
	_, nc := testkit.NATS(t)
	jobs := make(chan *transfer.Submit, 16)
	system, pid, m, _ := startEngineWith(t, nc, make(chan struct{}),
		func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
			d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
				Engine("e1", lay, testkit.NopDevice{})
			d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &submits{ch: jobs} }))
		})
	system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Batch: messages.EventBatch{Epoch: "a", Seq: 1,
		Events: readyChunk("r", 1)}})
	testkit.Recv(t, jobs, 5*time.Second, "r's store job, held in flight")
	system.Root.Send(pid, &engine.Retire{})

	handled := make(chan struct{}, 1)
	system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Batch: messages.EventBatch{Epoch: "a", Seq: 2,
		Events: []messages.Event{tokens("r", 4)}}, Done: actors.SignalFunc(func() { handled <- struct{}{} })})
	testkit.Recv(t, handled, 5*time.Second, "the late batch handled")
	require.Equal(t, 1.0, testutil.ToFloat64(m.Events.Rejected.WithLabelValues(messages.RejectUnknownEngine)),
		"kvactors_events_rejected_total{reason=unknown_engine}")
	require.Equal(t, 1.0, testutil.ToFloat64(m.Events.Batches), "only the first batch was received")
}

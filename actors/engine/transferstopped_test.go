package engine_test

import (
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// An engine actor that stops as a last resort after the node's transfer
// actor has stopped (node teardown, once a retire timed out) still
// releases its unreleased request, aborted, and closes Closed: its
// hand-off goes to the copy queue directly (Queue.DrainThen), not as a
// Drain message, which the stopped transfer actor would drop.
func TestAStoppingEngineReleasesItsRequestsAfterTheTransferActorStopped(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	var owed atomic.Int64
	var armed atomic.Bool
	var tr *actor.PID
	system, pid, _, _ := startEngineDeps(t, nc, closed, func(system *actor.ActorSystem, _ *sched.Layout, d *request.Deps) {
		d.Owed = &owed
		cfg := transfer.Config{Workers: 1}
		q := transfer.NewQueue(cfg, nil)
		d.Queue = q
		tr = system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: metrics.NewTransfer(nil),
			Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
		d.Transfer = tr
	}, func(d *engine.Deps) {
		d.Session = func() uint64 {
			if armed.CompareAndSwap(true, false) {
				panic("engine actor failure injected")
			}
			return 0
		}
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
	})
	sendBatch(system, pid, 1, added("r")) // r is live, unreleased, with no copy
	statusOf(t, system, pid)
	require.NoError(t, system.Root.StopFuture(tr).Wait())

	armed.Store(true)
	system.Root.Send(pid, &engine.Tick{}) // fails, and fails again in its end: it stops
	require.Equal(t, messages.ReasonAborted, recvRelease(t, released, "r's release").Reason)
	testkit.Closed(t, closed, 5*time.Second, "Closed (the hand-off must outlive the stopped transfer actor)")
	require.Zero(t, owed.Load())
}

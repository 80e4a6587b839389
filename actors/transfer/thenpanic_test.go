package transfer_test

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
)

// A Drain's Then that panics (its sender's bug) is recovered, logged and
// counted: the transfer actor keeps its state and its one set of workers
// (a restart would have lost its waiting Drains and started a second set
// on the same queue), and later Drains are answered.
func TestAPanickingThenLeavesTheTransferActorWhole(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	m := metrics.NewTransfer(nil)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20},
		Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	t.Cleanup(func() { close(dev.gate) })
	st := &gatedStore{dev: dev}

	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { panic("Then failure injected") }})
	then := make(chan struct{}, 1)
	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { then <- struct{}{} }})
	testkit.Recv(t, then, 5*time.Second, "the next Drain's Then")
	require.Equal(t, 1.0, testutil.ToFloat64(m.ThenFailures))

	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	time.Sleep(50 * time.Millisecond) // a second worker, if any, would start job 2 meanwhile
	require.Len(t, dev.startedCopies(), 1, "one worker: job 2 waits for job 1")
}

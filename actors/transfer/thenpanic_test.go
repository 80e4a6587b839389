package transfer_test

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// A Drain's Then that panics (its sender's bug) is recovered, logged and
// counted: the transfer actor keeps its state and its one set of workers
// (a restart would have started a second set on the same queue), and
// later Drains are answered.
func TestAPanickingThenLeavesTheTransferActorWhole(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	m := metrics.NewTransfer(nil)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20},
		Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{}), starts: make(chan struct{}, 4)}
	t.Cleanup(func() { close(dev.gate) })
	st := &gatedStore{dev: dev}

	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { panic("Then failure injected") }})
	then := make(chan struct{}, 1)
	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { then <- struct{}{} }})
	testkit.Recv(t, then, 5*time.Second, "the next Drain's Then")
	require.Equal(t, 1.0, testutil.ToFloat64(m.ThenFailures))

	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))
	testkit.Recv(t, dev.starts, 5*time.Second, "job 1's copy start")
	testkit.NoRecv(t, dev.starts, 100*time.Millisecond, "job 2's copy start (a second worker)")
	require.Len(t, dev.startedCopies(), 1, "one worker: job 2 waits for job 1")
}

// panicsOnAbort is a store whose Abort panics (the store's bug: the copy
// queue recovers it).
type panicsOnAbort struct{ *gatedStore }

func (panicsOnAbort) Abort(backend.Direction, []sched.JobChunk) {
	panic("store Abort failure injected")
}

// panicsOnInc is a counter whose Inc panics: a failure in the transfer
// actor's own turn (the unexpected-message counter).
type panicsOnInc struct{ prometheus.Counter }

func (panicsOnInc) Inc() { panic("counter failure injected") }

// unexpected is a message the transfer actor has no case for.
type unexpected struct{}

// A transfer actor whose turn panics is resumed, not restarted: a restart
// would start a second set of workers on the same queue. Its one worker still runs one copy at a time, and it goes on
// answering.
func TestAFailedTransferActorIsResumedWithItsWorkers(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20},
		Metrics: metrics.NewTransfer(nil), Unexpected: panicsOnInc{}, Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{}), starts: make(chan struct{}, 4)}
	t.Cleanup(func() { close(dev.gate) })
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	testkit.Recv(t, dev.starts, 5*time.Second, "job 1's copy start")
	system.Root.Send(pid, &unexpected{}) // counting it panics: the turn fails
	system.Root.Send(pid, job(owner, 3, backend.DeviceToHost, st, 1))
	then := make(chan struct{}, 1)
	other := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	system.Root.Send(pid, &transfer.Drain{Owner: other, Then: func() { then <- struct{}{} }})
	testkit.Recv(t, then, 5*time.Second, "a later Drain's Then")
	testkit.NoRecv(t, dev.starts, 100*time.Millisecond, "job 3's copy start (a second worker)")
	require.Len(t, dev.startedCopies(), 1, "one worker: job 3 waits for job 1")
}

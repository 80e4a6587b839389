package transfer_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// panicsOnCopy is a store whose Copy panics (a backend's bug).
type panicsOnCopy struct{ *gatedStore }

func (panicsOnCopy) Copy(backend.Direction, []sched.JobChunk, func() error) error {
	panic("store Copy failure injected")
}

// A Store.Copy that panics on a copy worker does not end the process: the
// panic is recovered, logged with its stack and counted, the job's pool
// side is aborted, its owner gets a JobDone failing with ErrCopyPanicked
// (so it retries the chunks, as after any failed copy), and the same
// worker (the only one) goes on to copy the next job.
func TestAPanickingCopyFailsItsJobAndTheWorkerGoesOn(t *testing.T) {
	m := metrics.NewTransfer(nil)
	var logged testkit.SyncBuffer
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20},
		Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(&logged, nil))}))
	done := make(chan *transfer.JobDone, 4)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	close(dev.gate)
	st := &gatedStore{dev: dev}

	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, panicsOnCopy{st}, 2))
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))

	first := testkit.Recv(t, done, 5*time.Second, "the panicked job's JobDone")
	require.EqualValues(t, 1, first.ID)
	require.ErrorIs(t, first.Err, transfer.ErrCopyPanicked)
	require.ErrorContains(t, first.Err, "store Copy failure injected")
	require.False(t, first.Cancelled, "a failed copy, not a cancelled one: the owner retries it")
	second := testkit.Recv(t, done, 5*time.Second, "the next job's JobDone, from the same worker")
	require.EqualValues(t, 2, second.ID)
	require.NoError(t, second.Err)

	copied, aborted := st.seen()
	require.Equal(t, []messages.Key{"j1-0", "j1-1"}, aborted, "the panicked job's pool side is aborted")
	require.Equal(t, []messages.Key{"j2-0"}, copied)
	require.Equal(t, 1.0, testutil.ToFloat64(m.CopyPanics))
	require.Equal(t, 1.0, testutil.ToFloat64(m.CopyFailures.WithLabelValues(backend.DeviceToHost.String())))
	require.Contains(t, logged.String(), "Store.Copy panicked")
	require.Contains(t, logged.String(), "copypanic_test.go", "the log carries the panic's stack")

	// A backend that panics on every copy: each counted, the stack logged
	// once a minute.
	system.Root.Send(pid, job(owner, 3, backend.DeviceToHost, panicsOnCopy{st}, 1))
	require.ErrorIs(t, testkit.Recv(t, done, 5*time.Second, "the second panicked job's JobDone").Err, transfer.ErrCopyPanicked)
	require.Equal(t, 2.0, testutil.ToFloat64(m.CopyPanics))
	require.Equal(t, 1, strings.Count(logged.String(), "Store.Copy panicked"), "a second stack within the minute")
}

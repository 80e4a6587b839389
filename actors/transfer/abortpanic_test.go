package transfer_test

import (
	"fmt"
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
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
)

// startCounted spawns a transfer actor with one worker over q (nil: its
// own queue), its collectors m, and an owner collecting its JobDones.
func startCounted(t *testing.T, m *metrics.Transfer, q *transfer.Queue) (*actor.ActorSystem, *actor.PID, *actor.PID, chan *transfer.JobDone) {
	t.Helper()
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20},
		Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	done := make(chan *transfer.JobDone, 16)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	return system, pid, owner, done
}

// A Drain whose owner has a queued job whose Store.Abort panics (the
// store's bug) is not lost: the panic is recovered and counted, the
// owner's other queued job is still aborted, each cancelled job still gets
// its JobDone, and Drained still comes once the owner's running copy ends.
func TestADrainWithAPanickingAbortIsStillAnswered(t *testing.T) {
	m := metrics.NewTransfer(nil)
	system, pid, owner, done := startCounted(t, m, nil)
	drained := make(chan *transfer.Drained, 4)
	replyTo := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &drainSink{ch: drained} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	t.Cleanup(func() { close(dev.gate) })
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, panicsOnAbort{st}, 1))
	system.Root.Send(pid, job(owner, 3, backend.DeviceToHost, st, 1))

	system.Root.Send(pid, &transfer.Drain{Owner: owner, ReplyTo: replyTo})
	for _, id := range []int{2, 3} {
		d := testkit.Recv(t, done, 5*time.Second, "a cancelled job's JobDone")
		require.EqualValues(t, id, d.ID)
		require.True(t, d.Cancelled)
	}
	_, aborted := st.seen()
	require.Equal(t, []messages.Key{"j3-0"}, aborted, "the job after the panicking Abort is aborted all the same")
	require.Equal(t, 1.0, testutil.ToFloat64(m.AbortFailures))
	testkit.NoRecv(t, drained, 50*time.Millisecond, "Drained while the owner's copy runs")

	dev.gate <- struct{}{} // job 1 ends
	require.True(t, testkit.Recv(t, drained, 5*time.Second, "Drained once job 1 ended").Owner.Equal(owner))
}

// Queue.DrainThen over a queued job whose Store.Abort panics still runs
// its Then (nothing of the owner copying: at once) and aborts the owner's
// other queued job; the panic is recovered and counted, not passed to the
// caller (whose guard would recover it and lose the Then: Closed would
// never close).
func TestQueueDrainThenWithAPanickingAbortStillRunsTheThen(t *testing.T) {
	m := metrics.NewTransfer(nil)
	q := transfer.NewQueue(transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}, m)
	system, _, owner, _ := startCounted(t, m, q)
	other := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: make(chan *transfer.JobDone, 8)} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	t.Cleanup(func() { close(dev.gate) })
	st := &gatedStore{dev: dev}
	q.Submit(job(other, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1) // the one worker is busy: owner's jobs stay queued
	q.Submit(job(owner, 2, backend.DeviceToHost, panicsOnAbort{st}, 1))
	q.Submit(job(owner, 3, backend.DeviceToHost, st, 1))

	then := make(chan struct{}, 1)
	var panicked any
	func() {
		defer func() { panicked = recover() }() // the caller's guard (the engine actor's)
		q.DrainThen(owner, func() { then <- struct{}{} })
	}()
	require.Nil(t, panicked, "the Abort's panic reached DrainThen's caller")
	testkit.Recv(t, then, 5*time.Second, "the Then, at once")
	_, aborted := st.seen()
	require.Equal(t, []messages.Key{"j3-0"}, aborted, "the job after the panicking Abort is aborted all the same")
	require.Equal(t, 1.0, testutil.ToFloat64(m.AbortFailures))
}

// A batch of completions whose counting panics part-way (a collector's
// bug: here the lapsed-copies counter, for the batch's first copy) loses
// neither a later copy's JobDone nor the Drained that waits for the
// batch's last copy: each owner still learns its job ended (and releases),
// and the drained owner's Drained comes now, not when some later copy
// completes (never, on an idle node). The actor is resumed.
func TestAPanickingCompletionMetricLosesNoJobDoneNorDrained(t *testing.T) {
	m := metrics.NewTransfer(nil)
	m.CopiesLapsed = panicsOnInc{m.CopiesLapsed}
	cfg := transfer.Config{Workers: 2, MaxInFlightBytes: 1 << 20}
	q := transfer.NewQueue(cfg, m)
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	other := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: make(chan *transfer.JobDone, 8)} }))
	drained := make(chan *transfer.Drained, 4)
	replyTo := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &drainSink{ch: drained} }))
	lapsing := &gatedDevice{gate: make(chan struct{}), fail: transfer.ErrSessionLapsed}
	fine := &gatedDevice{gate: make(chan struct{})}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, &gatedStore{dev: lapsing}, 1))
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, &gatedStore{dev: fine}, 1))
	waitStarted(t, lapsing, 1)
	waitStarted(t, fine, 1)
	system.Root.Send(pid, &transfer.Drain{Owner: owner, ReplyTo: replyTo}) // waits: both copies run

	// Hold the actor in a turn (a Drain's Then) while both copies end, so
	// that it reports them in one batch, the lapsed one first.
	hold, held := make(chan struct{}), make(chan struct{}, 1)
	system.Root.Send(pid, &transfer.Drain{Owner: other, Then: func() { held <- struct{}{}; <-hold }})
	testkit.Recv(t, held, 5*time.Second, "the actor held in a turn")
	inFlight := func(n float64) func() error {
		return func() error {
			if got := testutil.ToFloat64(m.JobsInFlight); got != n {
				return fmt.Errorf("%v copies running, want %v", got, n)
			}
			return nil
		}
	}
	close(lapsing.gate)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, inFlight(1))
	close(fine.gate)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, inFlight(0))
	close(hold)

	for _, id := range []int{1, 2} {
		d := testkit.Recv(t, done, 5*time.Second, "a JobDone of the batch")
		require.EqualValues(t, id, d.ID)
		require.Equal(t, id == 1, d.More, "More on all but the owner's last JobDone of the batch")
	}
	require.True(t, testkit.Recv(t, drained, 5*time.Second, "Drained once the batch was reported").Owner.Equal(owner))
}

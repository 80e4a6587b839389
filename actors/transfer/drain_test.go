package transfer_test

import (
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// drainSink collects Drained answers.
type drainSink struct{ ch chan *transfer.Drained }

func (s *drainSink) Receive(c actor.Context) {
	if m, ok := c.Message().(*transfer.Drained); ok {
		s.ch <- m
	}
}

// Drain (an owner that failed and will take no JobDone again): its queued
// jobs are cancelled with their pool side aborted and never run; Drained
// comes only once its running copy has ended; another owner's queued job
// is untouched and runs; an owner with nothing queued or running is
// answered at once.
func TestDrainCancelsQueuedJobsAndAnswersOnceNoneRuns(t *testing.T) {
	system, pid, owner, done := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	other := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: make(chan *transfer.JobDone, 8)} }))
	drained := make(chan *transfer.Drained, 4)
	replyTo := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &drainSink{ch: drained} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))
	system.Root.Send(pid, job(other, 3, backend.DeviceToHost, st, 1))

	system.Root.Send(pid, &transfer.Drain{Owner: owner, ReplyTo: replyTo})
	d := testkit.Recv(t, done, 5*time.Second, "the queued job's JobDone")
	require.Equal(t, sched.JobID(2), d.ID)
	require.True(t, d.Cancelled)
	_, aborted := st.seen()
	require.Equal(t, []messages.Key{"j2-0"}, aborted, "the queued job's pool side is aborted")
	testkit.NoRecv(t, drained, 50*time.Millisecond, "Drained while the owner's copy runs")

	dev.gate <- struct{}{} // job 1 ends
	require.True(t, testkit.Recv(t, drained, 5*time.Second, "Drained once job 1 ended").Owner.Equal(owner))
	waitStarted(t, dev, 2) // the other owner's job runs
	close(dev.gate)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if copied, _ := st.seen(); len(copied) < 2 {
			return fmt.Errorf("the other owner's job has not run")
		}
		return nil
	})
	copied, _ := st.seen()
	require.Equal(t, []messages.Key{"j1-0", "j3-0"}, copied, "the drained owner's queued job never ran")

	system.Root.Send(pid, &transfer.Drain{Owner: owner, ReplyTo: replyTo})
	require.True(t, testkit.Recv(t, drained, 5*time.Second, "Drained at once: nothing left").Owner.Equal(owner))
}

// A Drain with Then (its sender may be gone by then: an engine actor
// stopping) runs Then, and sends no Drained, once the owner's running copy
// has ended, at once when nothing runs; a Then still waiting when the
// transfer actor stops runs once its workers have finished their copies.
func TestDrainThenRunsOnceTheOwnersCopiesEnd(t *testing.T) {
	system, pid, owner, _ := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	then := make(chan string, 4)
	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { then <- "first" }})
	testkit.NoRecv(t, then, 50*time.Millisecond, "Then while the owner's copy runs")
	dev.gate <- struct{}{} // job 1 ends
	require.Equal(t, "first", testkit.Recv(t, then, 5*time.Second, "Then once job 1 ended"))
	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { then <- "at once" }})
	require.Equal(t, "at once", testkit.Recv(t, then, 5*time.Second, "Then at once: nothing left"))

	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 2)
	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { then <- "at stop" }})
	other := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &drainSink{} }))
	system.Root.Send(pid, &transfer.Drain{Owner: other, Then: func() { then <- "other" }})
	require.Equal(t, "other", testkit.Recv(t, then, 5*time.Second, "the Drain taken before the stop")) // the stop goes ahead of queued messages
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		_ = system.Root.StopFuture(pid).Wait()
	}()
	testkit.NoRecv(t, then, 50*time.Millisecond, "Then while the owner's copy runs, the actor stopping")
	close(dev.gate)
	require.Equal(t, "at stop", testkit.Recv(t, then, 5*time.Second, "Then as the actor stops"))
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the transfer actor did not stop")
	}
}

// Queue.DrainThen, called by its sender directly (it holds even once the
// transfer actor has stopped, when a Drain message would be dropped):
// the owner's queued job is aborted and never runs; Then runs once the
// owner's running copy has ended, on the worker that ended it; once the
// actor has stopped, it runs at once.
func TestQueueDrainThenRunsOnceTheOwnersCopiesEnd(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	cfg := transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}
	q := transfer.NewQueue(cfg, nil)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: metrics.NewTransfer(nil),
		Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: make(chan *transfer.JobDone, 8)} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	q.Submit(job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	q.Submit(job(owner, 2, backend.DeviceToHost, st, 1))

	then := make(chan string, 4)
	q.DrainThen(owner, func() { then <- "first" })
	_, aborted := st.seen()
	require.Equal(t, []messages.Key{"j2-0"}, aborted, "the queued job's pool side is aborted")
	testkit.NoRecv(t, then, 50*time.Millisecond, "Then while the owner's copy runs")
	dev.gate <- struct{}{} // job 1 ends
	require.Equal(t, "first", testkit.Recv(t, then, 5*time.Second, "Then once job 1 ended"))

	require.NoError(t, system.Root.StopFuture(pid).Wait())
	q.DrainThen(owner, func() { then <- "after the stop" })
	require.Equal(t, "after the stop", testkit.Recv(t, then, 5*time.Second, "Then at once, the actor stopped"))
	copied, _ := st.seen()
	require.Equal(t, []messages.Key{"j1-0"}, copied, "the drained owner's queued job never ran")
}

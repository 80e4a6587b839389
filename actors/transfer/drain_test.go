package transfer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
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

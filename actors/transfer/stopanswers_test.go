package transfer_test

import (
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// A transfer actor that stops still answers every load it took: the copy
// running finishes and its owner gets its JobDone; the loads still queued
// never run, their pool side is aborted (unpinned, room to read back from
// disk freed) and each owner gets a JobDone with Cancelled, as for Cancel:
// a load actor answers its engine on it and counts its load out, so the
// node's loads in flight drain.
func TestStoppingAnswersEveryLoadItTook(t *testing.T) {
	system, pid, owner, done := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.HostToDevice, st, 1))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.HostToDevice, st, 1))
	system.Root.Send(pid, job(owner, 3, backend.HostToDevice, st, 2))
	taken := make(chan struct{}, 1) // a Drain of nobody's behind the Submits: its Then runs once they are queued
	system.Root.Send(pid, &transfer.Drain{Owner: actor.NewPID("nonhost", "nobody"), Then: func() { taken <- struct{}{} }})
	testkit.Recv(t, taken, 5*time.Second, "the Submits taken") // the stop goes ahead of messages still in the mailbox
	stopped := make(chan error, 1)
	go func() { stopped <- system.Root.StopFuture(pid).Wait() }()
	testkit.NoRecv(t, done, 50*time.Millisecond, "a JobDone while the running load copies")
	close(dev.gate)

	got := map[sched.JobID]*transfer.JobDone{}
	for range 3 {
		d := testkit.Recv(t, done, 5*time.Second, "a JobDone of a load the actor took")
		got[d.ID] = d
	}
	require.Contains(t, got, sched.JobID(1))
	require.False(t, got[1].Cancelled, "the running load finished")
	require.NoError(t, got[1].Err)
	for _, id := range []sched.JobID{2, 3} {
		require.Contains(t, got, id)
		require.True(t, got[id].Cancelled, "queued load %d cancelled", id)
	}
	copied, aborted := st.seen()
	require.Equal(t, []messages.Key{"j1-0"}, copied, "no queued load ran")
	require.ElementsMatch(t, []messages.Key{"j2-0", "j3-0", "j3-1"}, aborted, "the queued loads' pool side is aborted")
	require.NoError(t, testkit.Recv(t, stopped, 5*time.Second, "the actor's stop"))
}

// A job pushed straight to the queue (Queue.Submit, as request and load
// actors do) after the transfer actor stopped never runs: its pool side is
// aborted, and a load's owner gets a JobDone with ErrQueueClosed (it
// answers its engine). A store is left unanswered, as the stores still
// queued at the stop are: its owner would decide again, and again, in a
// pool about to go. Before, a load sat in the closed queue, never answered,
// its engine waiting out its own timeout.
func TestAJobSubmittedAfterTheStopIsAbortedAndALoadAnswered(t *testing.T) {
	q := transfer.NewQueue(transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}, nil)
	system, pid, owner, done := startCounted(t, metrics.NewTransfer(nil), q)
	require.NoError(t, system.Root.StopFuture(pid).Wait())

	st := &gatedStore{dev: &gatedDevice{gate: make(chan struct{})}}
	q.Submit(job(owner, 1, backend.HostToDevice, st, 1))
	got := testkit.Recv(t, done, 5*time.Second, "the refused load's JobDone")
	require.Equal(t, sched.JobID(1), got.ID)
	require.ErrorIs(t, got.Err, transfer.ErrQueueClosed)
	q.Submit(job(owner, 2, backend.DeviceToHost, st, 1))
	copied, aborted := st.seen()
	require.Empty(t, copied)
	require.Equal(t, []messages.Key{"j1-0", "j2-0"}, aborted, "both jobs' pool side aborted")
	testkit.NoRecv(t, done, 50*time.Millisecond, "a JobDone for the refused store")
}

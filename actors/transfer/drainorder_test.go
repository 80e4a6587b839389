package transfer_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/sched"
)

// slowAbortStore is a gatedStore whose Abort blocks until released.
type slowAbortStore struct {
	*gatedStore
	inAbort chan struct{}
	release chan struct{}
	aborted atomic.Bool
}

func (s *slowAbortStore) Abort(dir backend.Direction, chunks []sched.JobChunk) {
	s.inAbort <- struct{}{}
	<-s.release
	s.gatedStore.Abort(dir, chunks)
	s.aborted.Store(true)
}

// A Drain's Then (the owner's release) runs only after the jobs it
// cancelled are aborted: queued before the aborts, it ran on the worker
// ending the owner's running copy while the drain was still aborting, and
// the cancelled keys stayed pending past the release.
func TestADrainsThenRunsAfterItsCancelledJobsAreAborted(t *testing.T) {
	system, pid, owner, _ := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &slowAbortStore{gatedStore: &gatedStore{dev: dev}, inAbort: make(chan struct{}, 1), release: make(chan struct{})}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1)) // runs
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1)) // queued
	ran := make(chan bool, 1)
	system.Root.Send(pid, &transfer.Drain{Owner: owner, Then: func() { ran <- st.aborted.Load() }})
	testkit.Recv(t, st.inAbort, 5*time.Second, "the drain aborting the queued job")
	close(dev.gate) // the running copy ends: its worker runs the Thens due
	testkit.NoRecv(t, ran, 200*time.Millisecond, "the Then while the drain still aborts")
	close(st.release)
	require.True(t, testkit.Recv(t, ran, 5*time.Second, "the Then"), "the Then ran before the queued job was aborted")
}

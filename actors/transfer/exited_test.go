package transfer_test

import (
	"testing"
	"time"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
)

// Exited closes once the workers have exited, before the stopping actor
// answers the loads left: a panic there (here a load queued with no owner,
// a submitter's bug) kept it open, and a node's shutdown waited its whole
// bound for copies that had ended, then left the arena mapped.
func TestExitedClosesOnceTheWorkersExitedWhateverFollows(t *testing.T) {
	q := transfer.NewQueue(transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}, nil)
	system, pid, owner, _ := startCounted(t, metrics.NewTransfer(nil), q)
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	q.Submit(job(owner, 1, backend.HostToDevice, st, 1))
	waitStarted(t, dev, 1)
	q.Submit(job(nil, 2, backend.HostToDevice, st, 1)) // answered at stop: panics
	system.Root.Stop(pid)
	testkit.NoRecv(t, q.Exited(), 50*time.Millisecond, "Exited while a copy runs")
	close(dev.gate)
	testkit.Closed(t, q.Exited(), 5*time.Second, "Exited once the copy ended")
}

// Stopped closes once the stopping actor is done with the queue (its loads
// answered, its Drains run): what a node's shutdown waits for after
// Exited, instead of a protoactor future, whose registration and 10 s
// timer kept the whole actor system reachable past the node's Close.
func TestStoppedClosesOnceTheActorIsDoneWithTheQueue(t *testing.T) {
	q := transfer.NewQueue(transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}, nil)
	system, pid, owner, _ := startCounted(t, metrics.NewTransfer(nil), q)
	drained := make(chan struct{})
	dev := &gatedDevice{gate: make(chan struct{})}
	q.Submit(job(owner, 1, backend.HostToDevice, &gatedStore{dev: dev}, 1))
	waitStarted(t, dev, 1)
	q.DrainThen(owner, func() { close(drained) }) // waits for the running copy
	system.Root.Stop(pid)
	testkit.NoRecv(t, q.Stopped(), 50*time.Millisecond, "Stopped while a copy runs")
	close(dev.gate)
	testkit.Closed(t, q.Stopped(), 5*time.Second, "Stopped once the copy ended")
	testkit.Closed(t, drained, time.Second, "the Drain run before Stopped")
}

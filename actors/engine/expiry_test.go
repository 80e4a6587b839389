package engine_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/sched"
)

// PROTOCOL.md "Engine liveness": a lease check expires an engine only when
// both the last sign of life its actor handled and the last message the
// node took for it (Deps.Arrived: a batch may wait in a backlog the actor
// has not reached) are a lease old.
func TestALeaseCheckCountsMessagesNotYetHandled(t *testing.T) {
	_, nc := testkit.NATS(t)
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	var clock, arrived atomic.Int64 // unix nanoseconds
	clock.Store(start.UnixNano())
	expired := make(chan string, 1)
	system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
		func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
			d.Lease = lease
			d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
			d.Arrived = func() time.Time { return time.Unix(0, arrived.Load()) }
			d.Expired = func(e string) { expired <- e }
		})
	tick := func(at time.Time) {
		clock.Store(at.UnixNano())
		system.Root.Send(pid, &engine.Tick{})
		statusOf(t, system, pid) // the Tick was handled: the status query came after it
	}

	// Silent for two leases as the actor sees it, but a message was taken
	// half a lease ago: alive.
	arrived.Store(start.Add(3 * lease / 2).UnixNano())
	tick(start.Add(2 * lease))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry with a message taken within the lease")

	// Nothing taken for a lease either: expired, once.
	tick(start.Add(5 * lease / 2))
	testkit.Recv(t, expired, 5*time.Second, "the expiry")
	tick(start.Add(3 * lease))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "a second expiry")
}

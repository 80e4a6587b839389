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

// PROTOCOL.md "Engine liveness": a message the node took for the engine
// since the last lease check (Deps.Arrivals: a batch may wait in a backlog
// the actor has not reached) is a sign of life at that check.
func TestALeaseCheckCountsMessagesNotYetHandled(t *testing.T) {
	_, nc := testkit.NATS(t)
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	var clock atomic.Int64 // unix nanoseconds
	var taken atomic.Uint64
	clock.Store(start.UnixNano())
	expired := make(chan string, 1)
	system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
		func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
			d.Lease = lease
			d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
			d.Arrivals = taken.Load
			d.Expired = func(e string) { expired <- e }
		})
	tick := func(at time.Time) {
		clock.Store(at.UnixNano())
		system.Root.Send(pid, &engine.Tick{})
		statusOf(t, system, pid) // the Tick was handled: the status query came after it
	}

	// Silent for two leases as the actor sees it, but a message was taken
	// since the last check: alive, and counted alive from this check on.
	taken.Add(1)
	tick(start.Add(2 * lease))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry with a message taken since the last check")
	tick(start.Add(2*lease + lease/2))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry within a lease of that check")

	// Nothing taken for a lease after it: expired, once.
	tick(start.Add(3 * lease))
	testkit.Recv(t, expired, 5*time.Second, "the expiry")
	tick(start.Add(4 * lease))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "a second expiry")
}

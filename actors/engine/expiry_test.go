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

// PROTOCOL.md "Engine liveness": a lease check does not expire an engine
// while messages the node has taken wait where the engine's would
// (Deps.Backlogged: a batch in a backlog is a sign of life the actor has not
// seen); a later check without a backlog does.
func TestALeaseCheckWaitsOutABacklog(t *testing.T) {
	_, nc := testkit.NATS(t)
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	var clock atomic.Int64 // unix nanoseconds
	var backlog atomic.Bool
	clock.Store(start.UnixNano())
	expired := make(chan string, 1)
	system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
		func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
			d.Lease = lease
			d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
			d.Backlogged = backlog.Load
			d.Expired = func(e string) { expired <- e }
		})
	tick := func(at time.Time) {
		clock.Store(at.UnixNano())
		system.Root.Send(pid, &engine.Tick{})
		statusOf(t, system, pid) // the Tick was handled: the status query came after it
	}

	// Silent for two leases as the actor sees it, but messages wait in its
	// shard: alive.
	backlog.Store(true)
	tick(start.Add(2 * lease))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry with messages still to handle")

	// The backlog drained with nothing of the engine in it: expired, once.
	backlog.Store(false)
	tick(start.Add(5 * lease / 2))
	testkit.Recv(t, expired, 5*time.Second, "the expiry")
	tick(start.Add(3 * lease))
	testkit.NoRecv(t, expired, 10*time.Millisecond, "a second expiry")
}

package engine_test

import (
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// PROTOCOL.md "Engine liveness": a lease check does not expire an engine
// while messages the node has taken wait where the engine's would
// (Deps.Backlogged: a batch in a backlog is a sign of life the actor has not
// seen), for at most one more lease; a later check without a backlog
// expires it, and so does one a second lease on, backlog or not (a dead
// engine sharing its shard with a busy one).
func TestALeaseCheckWaitsOutABacklog(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	for _, tc := range []struct {
		name          string
		backlogAtLast bool
		expireAt      time.Duration
	}{
		{"the backlog drains", false, 3 * lease / 2},
		{"the backlog lasts", true, 2 * lease},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, nc := testkit.NATS(t)
			var clock atomic.Int64 // unix nanoseconds
			clock.Store(start.UnixNano())
			var backlog atomic.Bool
			expired := make(chan *actor.PID, 1)
			system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
				func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
					d.Lease = lease
					d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
					d.Backlogged = backlog.Load
					d.Expired = func(_ string, self *actor.PID) bool { expired <- self; return true }
				})
			tick := func(at time.Duration) {
				clock.Store(start.Add(at).UnixNano())
				system.Root.Send(pid, &engine.Tick{})
				statusOf(t, system, pid) // the Tick was handled: the status query came after it
			}
			// Silent for more than a lease as the actor sees it, but messages
			// wait in its shard: alive.
			backlog.Store(true)
			tick(5 * lease / 4)
			testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry with messages still to handle")

			backlog.Store(tc.backlogAtLast)
			tick(tc.expireAt - time.Nanosecond)
			if !tc.backlogAtLast {
				self := testkit.Recv(t, expired, 5*time.Second, "the expiry once the backlog drained")
				require.True(t, self.Equal(pid), "the expiry names its own actor: the node ends only that one")
				return
			}
			testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry within the second lease")
			tick(tc.expireAt)
			testkit.Recv(t, expired, 5*time.Second, "the expiry a second lease on")
			tick(3 * lease)
			testkit.NoRecv(t, expired, 10*time.Millisecond, "a second expiry")
		})
	}
}

// A batch the intake hands over while a lease check runs lands behind the
// Tick in the mailbox, where the intake no longer counts it as a backlog:
// the check confirms an expiry only once every message queued before it is
// in (expiryCheck), so that batch's sign of life keeps the engine.
func TestABatchHandedOverDuringTheLeaseCheckKeepsTheEngine(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	_, nc := testkit.NATS(t)
	var clock atomic.Int64 // unix nanoseconds
	clock.Store(start.UnixNano())
	expired := make(chan string, 1)
	var system *actor.ActorSystem
	var pid *actor.PID
	var handed atomic.Bool
	system, pid, _, _ = startEngineDeps(t, nc, make(chan struct{}),
		func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
			d.Lease = lease
			d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
			d.Backlogged = func() bool {
				if handed.CompareAndSwap(false, true) {
					// The intake's worker, mid-check: its batch goes to the
					// mailbox and its marks say handled.
					system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "a", Seq: 1}})
				}
				return false
			}
			d.Expired = func(e string, _ *actor.PID) bool { expired <- e; return true }
		})
	tick := func(at time.Duration) {
		clock.Store(start.Add(at).UnixNano())
		system.Root.Send(pid, &engine.Tick{})
		statusOf(t, system, pid) // the Tick and what it queued were handled: the query came after them
	}
	tick(5 * lease / 4)
	require.True(t, handed.Load(), "the lease check asked about the backlog")
	testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry with a batch in the mailbox")
	require.Equal(t, uint64(1), statusOf(t, system, pid).Seq, "the batch was applied")

	tick(5*lease/4 + lease) // a lease of silence since the batch
	testkit.Recv(t, expired, 5*time.Second, "the expiry a lease after the batch")
}

// A batch the node dropped at intake (Lost with Alive) shows the engine
// alive, as the batch itself would have; a loss that names no engine does
// not.
func TestALostBatchOfTheEngineIsASignOfLife(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	_, nc := testkit.NATS(t)
	var clock atomic.Int64
	clock.Store(start.UnixNano())
	expired := make(chan *actor.PID, 1)
	system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
		func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
			d.Lease = lease
			d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
			d.Expired = func(_ string, self *actor.PID) bool { expired <- self; return true }
		})
	at := func(d time.Duration, m any) {
		clock.Store(start.Add(d).UnixNano())
		system.Root.Send(pid, m)
		statusOf(t, system, pid)
	}
	at(lease/2, &engine.Lost{Reason: messages.ResyncOverflow, AliveAt: start.Add(lease / 2)})
	at(3*lease/4, &engine.Lost{Reason: messages.ResyncOverflow}) // names no engine: no sign of life
	at(5*lease/4, &engine.Tick{})
	testkit.NoRecv(t, expired, 10*time.Millisecond, "an expiry under a lease after a sign of life")
	at(lease/2+lease, &engine.Tick{})
	testkit.Recv(t, expired, 5*time.Second, "the expiry a lease after the engine's lost batch")
}

// A sign of life the node dropped at intake is told late (Touch or Lost
// with its time): the actor stamps the time it came, not the time it is
// told, so the lease runs from the drop (PROTOCOL.md "Engine liveness");
// and never moves the last sign of life back, past a younger one handled
// meanwhile. A Touch without a time (a register) is stamped when handled.
func TestADroppedSignOfLifeCountsFromWhenItCame(t *testing.T) {
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	// engineAt starts an engine actor at start on a fake clock; at(d, m)
	// sends it m at start+d and waits until m, and a Tick's confirmation if
	// it sent one, are handled.
	engineAt := func(t *testing.T) (at func(time.Duration, any), expired chan *actor.PID) {
		_, nc := testkit.NATS(t)
		var clock atomic.Int64
		clock.Store(start.UnixNano())
		expired = make(chan *actor.PID, 1)
		system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
			func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
				d.Lease = lease
				d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
				d.Expired = func(_ string, self *actor.PID) bool { expired <- self; return true }
			})
		return func(d time.Duration, m any) {
			clock.Store(start.Add(d).UnixNano())
			system.Root.Send(pid, m)
			statusOf(t, system, pid)
			statusOf(t, system, pid)
		}, expired
	}
	for _, tc := range []struct {
		name string
		told func(at time.Time) any
	}{
		{"touch", func(at time.Time) any { return &engine.Touch{At: at} }},
		{"lost", func(at time.Time) any { return &engine.Lost{Reason: messages.ResyncOverflow, AliveAt: at} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			at, expired := engineAt(t)
			at(3*lease/4, tc.told(start.Add(lease/2))) // dropped at lease/2, told at 3/4
			at(lease/2+lease-time.Nanosecond, &engine.Tick{})
			testkit.NoRecv(t, expired, 0, "an expiry under a lease after the drop")
			at(lease/2+lease, &engine.Tick{})
			testkit.Recv(t, expired, 5*time.Second, "the expiry a lease after the drop, not after it was told")
		})
	}
	t.Run("never back", func(t *testing.T) {
		at, expired := engineAt(t)
		at(3*lease/4, &engine.Touch{})                                                              // a register, stamped now
		at(3*lease/4, &engine.Touch{At: start.Add(lease / 4)})                                      // an older drop, told later
		at(3*lease/4, &engine.Lost{Reason: messages.ResyncOverflow, AliveAt: start.Add(lease / 2)}) // and another
		at(3*lease/4+lease-time.Nanosecond, &engine.Tick{})
		testkit.NoRecv(t, expired, 0, "an expiry under a lease after the youngest sign of life")
		at(3*lease/4+lease, &engine.Tick{})
		testkit.Recv(t, expired, 5*time.Second, "the expiry a lease after the youngest sign of life")
	})
}

// An actor whose engine registered again under another actor (a new spec)
// may still see its lease run out before it stops: the node ignores that
// report (Deps.Expired is false), and the actor does not warn that the
// engine expired; one the node ended does.
func TestAStaleExpiryIsNoWarning(t *testing.T) {
	for _, current := range []bool{true, false} {
		t.Run(map[bool]string{true: "current", false: "stale"}[current], func(t *testing.T) {
			const lease = time.Minute
			start := time.Unix(1_800_000_000, 0)
			_, nc := testkit.NATS(t)
			var clock atomic.Int64
			clock.Store(start.UnixNano())
			var logs testkit.SyncBuffer
			reported := make(chan struct{}, 1)
			system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
				func(*actor.ActorSystem, *sched.Layout, *request.Deps) {}, func(d *engine.Deps) {
					d.Lease = lease
					d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
					d.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
					d.Expired = func(string, *actor.PID) bool { reported <- struct{}{}; return current }
				})
			clock.Store(start.Add(2 * lease).UnixNano())
			system.Root.Send(pid, &engine.Tick{})
			testkit.Recv(t, reported, 5*time.Second, "the expiry's report")
			statusOf(t, system, pid) // the turn that reported has ended
			require.Equal(t, current, strings.Contains(logs.String(), "engine expired"), logs.String())
		})
	}
}

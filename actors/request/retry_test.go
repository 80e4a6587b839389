package request_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// gatedStore refuses room while refuse is set (every decision becomes a
// retry); after that each PrepareStore waits for gate, as a decision waits
// for a pool or release lock another goroutine holds.
type gatedStore struct {
	request.Store
	refuse  atomic.Bool
	gate    chan struct{}
	entered chan struct{}
}

func (s *gatedStore) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if s.refuse.Load() {
		return errors.New("no room")
	}
	select {
	case s.entered <- struct{}{}:
	default:
	}
	<-s.gate
	return s.Store.PrepareStoreInto(out, keys, sizes)
}

// A request actor runs its retry on whoever delivers it. Retries of many
// requests whose decisions block must wait in the engine's timers, not each
// on a goroutine of its own: a 100k-request burst once held 66,000 such
// goroutines (+550 MiB of stacks). Every retry still runs once the block
// clears, and every chunk is stored.
func TestBlockedRetriesWaitInTheTimers(t *testing.T) {
	const n = 200 // the rig's engine has 64 GPU blocks: requests share them
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, n)
	system, deps := rig.system, rig.deps
	gs := &gatedStore{Store: deps.Store, gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	gs.refuse.Store(true)
	deps.Store = gs

	for i := range n {
		id := fmt.Sprintf("r%d", i)
		pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: id,
			PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
		// Inline mailbox: the first decision (no room, a retry armed) runs here.
		system.Root.Send(pid, &request.Events{Events: []messages.Event{
			{Type: messages.EvHashes, Request: id, Hashes: []messages.Hash{messages.Hash(id)}},
			{Type: messages.EvBlocks, Request: id, IDs: []messages.BlockID{messages.BlockID(1 + i%63)}},
			{Type: messages.EvTokens, Request: id, Computed: 4, Total: 4}}})
	}
	// Each request armed one retry (one may be on its way through the
	// delivering goroutine, refused and re-armed, as this reads).
	require.GreaterOrEqual(t, deps.Timers.Pending(), n-1)
	before := runtime.NumGoroutine()
	gs.refuse.Store(false)
	testkit.Recv(t, gs.entered, 10*time.Second, "a retry's decision")
	require.Equal(t, n-1, deps.Timers.Pending(), "one retry blocked, the others due and waiting their turn")
	require.Equal(t, float64(n-1), testutil.ToFloat64(rig.store.RetriesPending), "kvactors_store_retries_pending")
	require.LessOrEqual(t, runtime.NumGoroutine(), before+2, "no goroutine per blocked retry")

	close(gs.gate)
	stored := map[messages.Key]bool{}
	for len(stored) < n {
		sub := testkit.Recv(t, rig.seen, 10*time.Second, "a store job").(*transfer.Submit)
		for _, c := range sub.Chunks {
			stored[c.Key] = true
		}
	}
	require.Zero(t, deps.Timers.Pending())
	require.Zero(t, testutil.ToFloat64(rig.store.RetriesPending))
}

// A reused actor ignores a retry timer armed for the request it served
// before: taken, it would clear the current request's armed retry and
// decide again, and every later refusal would then keep two timers going.
func TestAStaleRetryOfAnEarlierRequestIsIgnored(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps := rig.system, rig.deps
	gs := &gatedStore{Store: deps.Store, gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	gs.refuse.Store(true) // every decision: no room, a retry
	deps.Store = gs
	par := &parentStub{sp: request.NewSpawner(), deps: &deps, pids: make(chan *actor.PID, 1), idle: make(chan int, 1)}
	parent := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return par }))
	spawn := func(id string) *actor.PID {
		system.Root.Send(parent, &spawnMsg{added: messages.Event{Type: messages.EvAdded, Request: id, PromptTokens: 4, MaxOffloadTokens: -1}})
		return testkit.Recv(t, par.pids, 5*time.Second, "pid")
	}

	// r1 is released at once: its actor goes idle.
	p1 := spawn("r1")
	system.Root.Send(p1, &request.Events{Events: []messages.Event{
		{Type: messages.EvFinished, Request: "r1", Computed: 4, Total: 4}}})
	testkit.Recv(t, released, 5*time.Second, "r1 released")
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		system.Root.Send(parent, &idleQ{})
		if n := <-par.idle; n != 1 {
			return fmt.Errorf("%d idle actors, want 1", n)
		}
		return nil
	})
	// r2, on the same actor, has a chunk ready and no room: one retry armed.
	p2 := spawn("r2")
	require.True(t, p2.Equal(p1), "the released actor is reused")
	system.Root.Send(p2, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r2", Hashes: []messages.Hash{"h"}},
		{Type: messages.EvBlocks, Request: "r2", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r2", Computed: 4, Total: 4}}})
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := deps.Timers.Pending(); n != 1 {
			return fmt.Errorf("%d retries armed, want r2's one", n)
		}
		return nil
	})
	// r1's retry, armed before its release, falls due now.
	system.Root.Send(p2, request.RetryDueFor(1, 1))
	require.Never(t, func() bool { return deps.Timers.Pending() > 1 }, 100*time.Millisecond, time.Millisecond,
		"r2 keeps one retry, not a second one started by r1's stale timer")
}

// An idle actor that stopped (Forget) is never handed the next request:
// the request would go to a dead mailbox and never be released. Forgetting
// an actor that is not idle changes nothing.
func TestAStoppedIdleActorIsNotReused(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	sp := request.NewSpawner()
	a, b := actor.NewPID("nonhost", "a"), actor.NewPID("nonhost", "b")
	sp.Release(nil, a) // below MaxIdle: kept, the context is not used
	sp.Release(nil, b)
	sp.Forget(b) // the most recent idle actor stopped
	sp.Forget(actor.NewPID("nonhost", "busy"))
	added := &messages.Event{Type: messages.EvAdded, Request: "r", PromptTokens: 4}
	got := sp.Spawn(system.Root, nil, added, context.Background())
	require.True(t, got.Equal(a), "handed to %v, want the live idle actor a", got)
}

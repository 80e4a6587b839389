package actors_test

import (
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/internal/testkit"
)

// Runs scheduled one after another, as a mailbox schedules them, all run on
// one goroutine that is not the scheduler's: the point of the dispatcher is
// that a run never starts on a fresh stack.
func TestLoopDispatcherRunsEveryRunOnOneGoroutine(t *testing.T) {
	d := actors.NewLoopDispatcher()
	defer d.Close()
	ids := map[uint64]int{}
	for range 100 {
		ran := make(chan uint64)
		d.Schedule(func() { ran <- goroutineID() })
		ids[<-ran]++
	}
	require.Len(t, ids, 1, "every run on the same goroutine")
	require.NotContains(t, ids, goroutineID())
	require.Equal(t, 300, d.Throughput())
}

// Close from inside a run (an actor's Stopped) lets the loop exit after that
// run; a run scheduled afterwards still runs, on a goroutine of its own.
func TestLoopDispatcherClosesFromItsOwnRunAndDropsNothing(t *testing.T) {
	d := actors.NewLoopDispatcher()
	closed := make(chan struct{})
	d.Schedule(func() { d.Close(); close(closed) })
	testkit.Closed(t, closed, 10*time.Second, "the closing run")
	testkit.Closed(t, d.Exited(), 10*time.Second, "the loop to exit")
	late := make(chan struct{})
	d.Schedule(func() { close(late) })
	testkit.Closed(t, late, 10*time.Second, "a run scheduled after Close")
	d.Close() // twice is fine
}

// A dispatcher that never ran anything has no goroutine to end: Close
// says so at once.
func TestAnUnusedLoopDispatcherClosesAtOnce(t *testing.T) {
	d := actors.NewLoopDispatcher()
	d.Close()
	testkit.Closed(t, d.Exited(), 10*time.Second, "Exited of a loop that never started")
	ran := make(chan struct{})
	d.Schedule(func() { close(ran) })
	testkit.Closed(t, ran, 10*time.Second, "a run scheduled after Close")
}

// More runs than the loop holds, scheduled while it is busy: every one runs.
func TestLoopDispatcherBackedUpStillRunsEverything(t *testing.T) {
	d := actors.NewLoopDispatcher()
	defer d.Close()
	block := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(21)
	d.Schedule(func() { <-block; wg.Done() })
	for range 20 {
		d.Schedule(wg.Done)
	}
	close(block)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	testkit.Closed(t, done, 10*time.Second, "every run")
}

// loopActor closes its loop when it stops, as the transfer and engine actors
// do, and reports the goroutine each message ran on.
type loopActor struct {
	loop *actors.LoopDispatcher
	ran  chan uint64
}

func (a *loopActor) Receive(c actor.Context) {
	switch c.Message().(type) {
	case *actor.Stopped:
		a.loop.Close()
	case string:
		a.ran <- goroutineID()
	}
}

func TestAnActorOnALoopDispatcherKeepsOneGoroutineAndEndsIt(t *testing.T) {
	system := actor.NewActorSystem()
	loop := actors.NewLoopDispatcher()
	ran := make(chan uint64, 1)
	pid := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &loopActor{loop: loop, ran: ran} },
		actor.WithDispatcher(loop)))
	ids := map[uint64]bool{}
	for range 50 { // each message finds the mailbox idle: one run each
		system.Root.Send(pid, "m")
		ids[<-ran] = true
	}
	require.Len(t, ids, 1)
	require.NoError(t, system.Root.StopFuture(pid).Wait())
	testkit.Closed(t, loop.Exited(), 10*time.Second, "the actor's loop to exit after it stopped")
}

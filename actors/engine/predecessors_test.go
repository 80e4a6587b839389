package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// An engine actor made while an earlier actor of its engine still ends
// (Deps.Predecessors) releases nothing until each predecessor has closed:
// not a preemption, not a finished for a request it never knew (deferred),
// not a request of an id reset twice meanwhile (its epochs' lineage within
// this actor stays held too). Once the predecessor closes, each goes out,
// oldest epoch first, as the lineage within one actor orders them.
func TestAnActorReleasesNothingUntilItsPredecessorsClosed(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor := make(chan struct{})
	system, pid, jobs := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Predecessors = []<-chan struct{}{predecessor}
	})
	send := epochSender(system, pid)
	preempted := func(id string) messages.Event { return messages.Event{Type: messages.EvPreempted, Request: id} }
	finished := func(id string) messages.Event {
		return messages.Event{Type: messages.EvFinished, Request: id, Computed: 4, Total: 4}
	}

	send("b", 1, added("p"), preempted("p"), finished("u"), added("r"),
		messages.Event{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{2}}) // r holds a block: reset, it is released
	// c resets b's r (its lineage within this actor) and stores q's chunk.
	send("c", 1, append(append([]messages.Event{added("r")}, readyChunk("q", 3)...), preempted("r"))...)
	j := testkit.Recv(t, jobs, 5*time.Second, "c's q: its store job")
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	send("c", 2, finished("q"))
	statusOf(t, system, pid)
	testkit.NoRecv(t, released, 100*time.Millisecond, "a release while the predecessor still ends")

	close(predecessor)
	got := map[string][]messages.Released{}
	for range 5 {
		rel := releaseOf(t, released)
		got[rel.Request] = append(got[rel.Request], rel)
	}
	// p's preemption, still owed when c began, is replaced by c's reset.
	require.Equal(t, []messages.Released{{Request: "p", Epoch: "b", RSeq: got["p"][0].RSeq, Reason: messages.ReasonEngineReset}}, got["p"])
	require.Equal(t, []messages.Released{{Request: "u", Epoch: "b", RSeq: got["u"][0].RSeq, Reason: messages.ReasonFinished}}, got["u"])
	require.Equal(t, []messages.Released{{Request: "q", Epoch: "c", RSeq: got["q"][0].RSeq, Reason: messages.ReasonFinished}}, got["q"])
	require.Len(t, got["r"], 2)
	require.Equal(t, "b", got["r"][0].Epoch, "b's r (reset) first")
	require.Equal(t, messages.ReasonEngineReset, got["r"][0].Reason)
	require.Equal(t, messages.Released{Request: "r", Epoch: "c", RSeq: got["r"][1].RSeq, Reason: messages.ReasonPreempted}, got["r"][1])
	testkit.NoRecv(t, released, 50*time.Millisecond, "a release more")
}

// With its predecessors closed before it started, an actor holds nothing.
func TestAnActorWhosePredecessorsClosedHoldsNothing(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor := make(chan struct{})
	close(predecessor)
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Predecessors = []<-chan struct{}{predecessor}
	})
	epochSender(system, pid)("b", 1, added("p"), messages.Event{Type: messages.EvPreempted, Request: "p"})
	require.Equal(t, messages.Released{Request: "p", Epoch: "b", RSeq: 1, Reason: messages.ReasonPreempted}, releaseOf(t, released))
}

// An actor retired (unregister, expiry, another register) while it awaits
// its predecessors, holding no request but a deferred release (a finished
// for a request it never knew), stops only once they have closed: its
// deferred release goes out and its Closed closes (so an unregister is
// answered) only then, never while a predecessor's copy still reads the
// blocks that release frees.
func TestARetireWhileAwaitingPredecessorsWaitsForThem(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor, closed := make(chan struct{}), make(chan struct{})
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Predecessors = []<-chan struct{}{predecessor}
		d.Closed = closed
	})
	epochSender(system, pid)("b", 1, messages.Event{Type: messages.EvFinished, Request: "u", Computed: 4, Total: 4})
	statusOf(t, system, pid)

	count := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count})
	testkit.NoRecv(t, released, 200*time.Millisecond, "u's deferred release while the predecessor still ends")
	select {
	case <-closed:
		t.Fatal("closed while its predecessor still ends")
	default:
	}

	close(predecessor)
	require.Equal(t, messages.Released{Request: "u", Epoch: "b", RSeq: 1, Reason: messages.ReasonFinished}, releaseOf(t, released))
	testkit.Closed(t, closed, 5*time.Second, "Closed, once the predecessor closed and u's release went out")
	require.Equal(t, 0, testkit.Recv(t, count, 5*time.Second, "the retire's count"))
}

// A request actor that fails while its release is held for a predecessor
// still ending is released (aborted) once the predecessor closed, not at
// once, also with no copy of its own to wait for (no transfer actor): the
// predecessor's copies may still read the blocks its release frees.
func TestAFailedRequestWithNoCopiesWaitsForThePredecessors(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor := make(chan struct{})
	fs := holdingFaultyStore(t)
	system, pid, m, _ := startEngineDeps(t, nc, make(chan struct{}),
		func(_ *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
			fs.over(lay)
			d.Store = fs // no transfer actor: no copy can run
		}, func(d *engine.Deps) { d.Predecessors = []<-chan struct{}{predecessor} })
	fs.arm.Store(true) // r's first decision panics
	epochSender(system, pid)("a", 1, readyChunk("r", 1)...)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if testutilValue(m) != 1 {
			return errString("r's failure not handled yet")
		}
		return nil
	})
	statusOf(t, system, pid)
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 100*time.Millisecond, "r released while the predecessor still ends")

	close(predecessor)
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted}, releaseOf(t, released))
	testkit.NoRecv(t, released, 50*time.Millisecond, "a release more")
}

// An epoch that ends while a predecessor still ends keeps its release count
// until the predecessor closed: the predecessor (its engine's Releases is
// this actor's) may still number a release of it, which must follow its
// earlier ones, not start at rseq 1 again.
func TestAnEpochEndedWhilePredecessorsEndKeepsItsCount(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor := make(chan struct{})
	var rels *actors.Releases
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Predecessors = []<-chan struct{}{predecessor}
		rels = d.Releases
	})
	require.True(t, rels.Publish(context.Background(), "a", "old", messages.ReasonEngineReset, nil)) // the predecessor's
	require.Equal(t, uint64(1), releaseOf(t, released).RSeq)
	send := epochSender(system, pid)
	send("a", 1)             // the predecessor's epoch goes on here, with no request
	send("b", 1, added("q")) // a ends
	statusOf(t, system, pid)
	require.True(t, rels.Publish(context.Background(), "a", "old2", messages.ReasonEngineReset, nil)) // the predecessor's, later
	require.Equal(t, messages.Released{Request: "old2", Epoch: "a", RSeq: 2, Reason: messages.ReasonEngineReset}, releaseOf(t, released))
	close(predecessor)
}

package engine_test

import (
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// submits collects the store jobs request actors send to the transfer
// actor; it never answers them (the copies stay in flight, the test ends
// them). A Drain (a failed request) is answered at once: its copies are the
// test's to hold; drains, if set, is handed each one first. A probe is
// echoed once what was sent before it has been handled.
type submits struct {
	ch     chan *transfer.Submit
	drains chan *transfer.Drain
}

type probe struct{ done chan struct{} }

func (s *submits) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *transfer.Submit:
		s.ch <- m
	case probe:
		m.done <- struct{}{}
	case *transfer.Drain:
		if s.drains != nil {
			s.drains <- m
		}
		if m.Then != nil {
			m.Then()
			break
		}
		c.Send(m.ReplyTo, &transfer.Drained{Owner: m.Owner})
	}
}

// startSubmitting starts engine e1 whose requests decide against a small
// pool and send their store jobs to the returned channel (never answered:
// the copies stay in flight); edit sets the engine's deps.
func startSubmitting(t *testing.T, nc *nats.Conn, edit func(*engine.Deps)) (*actor.ActorSystem, *actor.PID, chan *transfer.Submit) {
	t.Helper()
	jobs := make(chan *transfer.Submit, 16)
	system, pid, _, _ := startEngineDeps(t, nc, make(chan struct{}),
		func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
			d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
				Engine("e1", lay, testkit.NopDevice{})
			d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &submits{ch: jobs} }))
		}, edit)
	return system, pid, jobs
}

// readyChunk is a request whose one chunk (its hash, block) is ready.
func readyChunk(id string, block messages.BlockID) []messages.Event {
	return []messages.Event{added(id),
		{Type: messages.EvHashes, Request: id, Hashes: []messages.Hash{messages.Hash("h-" + id)}},
		{Type: messages.EvBlocks, Request: id, IDs: []messages.BlockID{block}}, tokens(id, 4)}
}

// PROTOCOL.md "Fencing, node side", lapse: when the node's fence generation
// moves (an engine may have declared the node lost), the engine actor
// resyncs its epoch (reason reconnect) and resets its requests
// (engine_reset, old epoch) before it handles anything else, drops the old
// epoch's later batches, and stamps the next epoch's copies with the new
// generation; the old epoch's copies carried the old one.
func TestLapseResyncsAndResetsTheEpoch(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	var gen atomic.Uint64
	var clock atomic.Int64 // unix nanoseconds: resyncs repeat by it
	clock.Store(time.Unix(1_800_000_000, 0).UnixNano())
	const lease = time.Minute
	system, pid, jobs := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Session, d.Lease = gen.Load, lease
		d.Now = func() time.Time { return time.Unix(0, clock.Load()) }
	})
	send := epochSender(system, pid)

	send("a", 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "r's store job")
	require.Zero(t, j.Session, "stamped with the epoch's session")

	gen.Store(1) // the fence recorded a lapse
	system.Root.Send(pid, &engine.Lapsed{})
	statusOf(t, system, pid) // Lapsed handled at the clock's time
	// r's copy is in flight (never answered here): its release waits for it,
	// but the request is reset; the old epoch's later batches are dropped,
	// and the resync is not repeated for them however long the lapse lasts.
	clock.Add(int64(lease))
	send("a", 2, readyChunk("late", 2)...)
	system.Root.Send(pid, &engine.Heartbeat{Epoch: "a", Seq: 3})
	testkit.NoRecv(t, jobs, 50*time.Millisecond, "a store job of the lapsed epoch")
	st := statusOf(t, system, pid)
	require.True(t, st.Resyncing)
	require.Empty(t, st.Requests, "the old epoch's requests are still live")
	// The resync order waits for the lapse's end: sent now, it would sit in
	// the node's reconnect buffer and reach the engine first, and the epoch
	// it starts would be stamped lapsed and reset again.
	testkit.NoRecv(t, resyncs, 20*time.Millisecond, "a resync while the lapse lasts")

	// The lapse ends (the generation moves again; the node tells every
	// engine actor): the order held back goes out, once.
	gen.Store(2)
	system.Root.Send(pid, &engine.Lapsed{})
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the resync").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
	require.Equal(t, messages.ResyncReconnect, rs.Reason)
	system.Root.Send(pid, &engine.Tick{})
	statusOf(t, system, pid)
	testkit.NoRecv(t, resyncs, 20*time.Millisecond, "the held order twice")
	// The engine's new epoch is stamped with the generation after the lapse
	// and kept: no second reset, no second order.
	send("b", 1, readyChunk("n", 3)...)
	var rel messages.Released
	j2 := testkit.Recv(t, jobs, 5*time.Second, "n's store job")
	require.Equal(t, uint64(2), j2.Session)
	testkit.NoRecv(t, released, 20*time.Millisecond, "r's release while its copy is in flight")
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID, Err: transfer.ErrSessionLapsed})
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's release").Data, &rel))
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonEngineReset}, rel)
	system.Root.Send(pid, &engine.Tick{})
	st = statusOf(t, system, pid)
	require.Equal(t, "b", st.Epoch)
	require.False(t, st.Resyncing)
	require.Len(t, st.Requests, 1, "the new epoch's request lives on")
	testkit.NoRecv(t, resyncs, 20*time.Millisecond, "a second resync")
}

// A batch taken before a lapse ended (stamped with the lapse's generation:
// it waited in the node's socket while the engine may have given the node
// up and reused its blocks) cannot begin a fresh epoch: nothing of it is
// routed, and the epoch is resynced, so an engine still in it starts another.
// A batch taken after the lapse begins its epoch normally.
func TestABatchTakenBeforeALapseEndedBeginsNoFreshEpoch(t *testing.T) {
	_, nc := testkit.NATS(t)
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	var gen atomic.Uint64
	gen.Store(2) // a lapse (generation 1) has ended
	system, pid, jobs := startSubmitting(t, nc, func(d *engine.Deps) { d.Session = gen.Load })
	send := func(epoch string, session uint64, evs ...messages.Event) {
		system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: epoch, Seq: 1, Events: evs},
			Session: session, Stamped: true})
	}

	send("old", 1, readyChunk("r", 1)...) // taken before the lapse's end
	testkit.NoRecv(t, jobs, 50*time.Millisecond, "a store job of a stillborn epoch")
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "its resync").Data, &rs))
	require.Equal(t, "old", rs.Epoch)
	require.Equal(t, messages.ResyncReconnect, rs.Reason)
	require.Equal(t, uint64(1), rs.Expected, "nothing of it applied")
	st := statusOf(t, system, pid)
	require.Empty(t, st.Requests)
	require.Zero(t, st.Seq, "a heartbeat reply would say nothing of the epoch was applied")
	require.True(t, st.Resyncing)

	send("new", 2, readyChunk("n", 2)...) // taken after it
	j := testkit.Recv(t, jobs, 5*time.Second, "the new epoch's store job")
	require.Equal(t, uint64(2), j.Session)
	require.Equal(t, "new", statusOf(t, system, pid).Epoch)
}

// An engine actor started while a lapse lasts (an odd fence generation: a
// register during it) holds its resync orders as one that saw the lapse
// begin does: a gap in its first epoch is resynced when the lapse ends.
func TestAnEngineBegunDuringALapseHoldsItsOrders(t *testing.T) {
	_, nc := testkit.NATS(t)
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	var gen atomic.Uint64
	gen.Store(1)
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) { d.Session = gen.Load })
	system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "a", Seq: 1}, Session: 1, Stamped: true})
	system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "a", Seq: 3}, Session: 1, Stamped: true})
	require.True(t, statusOf(t, system, pid).Resyncing, "the gap was seen")
	testkit.NoRecv(t, resyncs, 20*time.Millisecond, "a resync while the lapse lasts")

	gen.Store(2)
	system.Root.Send(pid, &engine.Lapsed{})
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the resync").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
}

// A late batch of an epoch that ended (the sequencer's Stale) is never
// applied: its events reach no request of the live epoch, nor start one.
func TestALateBatchOfAnEndedEpochIsNotApplied(t *testing.T) {
	_, nc := testkit.NATS(t)
	system, pid, jobs := startSubmitting(t, nc, nil)
	send := epochSender(system, pid)
	send("a", 1, added("old"))
	send("b", 1, added("live"))
	send("a", 2, readyChunk("late", 1)...) // sent in a before b began, arriving after
	send("a", 3, tokens("live", 4))
	testkit.NoRecv(t, jobs, 50*time.Millisecond, "a store job from the late batch")
	reqs := requestsOf(t, system, pid)
	require.Len(t, reqs, 1, "only the live epoch's request")
	require.Equal(t, "live", reqs[0].Request)
	require.Zero(t, reqs[0].Computed, "the late batch's tokens were not applied to the live request")
}

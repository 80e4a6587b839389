package engine_test

import (
	"encoding/json"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// An engine that resyncs re-announces its live requests, with the same
// blocks, in the new epoch, and frees a request's blocks on a release of
// that epoch. So while epoch a's request r still copies from block 1 (its
// reset waits for that copy), epoch b's r, with block 1 too, releases
// nothing: not a preemption, not its end, not a finished for an r the
// node does not know. Each release comes once a's copy has ended, and a's
// own release (engine_reset, epoch a) comes first.
func TestANewEpochsRequestReleasesNothingWhileAnOlderOneCopies(t *testing.T) {
	preempted := func(id string) messages.Event { return messages.Event{Type: messages.EvPreempted, Request: id} }
	finished := func(id string) messages.Event {
		return messages.Event{Type: messages.EvFinished, Request: id, Computed: 4, Total: 4}
	}
	for _, tc := range []struct {
		name    string
		b       func() []messages.Event // epoch b's first batch
		reason  string                  // of b's release
		bStores bool                    // b's r has a chunk of its own to store
	}{
		{"preempted, re-announced", func() []messages.Event { return append(readyChunk("r", 1), preempted("r")) }, messages.ReasonPreempted, false},
		{"finished, re-announced", func() []messages.Event { return append(readyChunkOf("r", "h-r2", 1), finished("r")) }, messages.ReasonFinished, true},
		{"finished, never announced", func() []messages.Event { return []messages.Event{finished("r")} }, messages.ReasonFinished, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			released, system, pid, send, jobs, j := copyingInEpochA(t)

			send("b", 1, tc.b()...)
			statusOf(t, system, pid)
			if tc.bStores { // b's r stores a chunk of its own: that copy ends first
				jb := testkit.Recv(t, jobs, 5*time.Second, "b's store job")
				system.Root.Send(jb.Owner, &transfer.JobDone{ID: jb.ID})
				statusOf(t, system, pid)
			}
			testkit.NoRecv(t, released, 100*time.Millisecond, "a release of r while a's copy of block 1 runs")

			system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
			got := []messages.Released{releaseOf(t, released), releaseOf(t, released)}
			require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: got[0].RSeq, Reason: messages.ReasonEngineReset}, got[0])
			require.Equal(t, messages.Released{Request: "r", Epoch: "b", RSeq: got[1].RSeq, Reason: tc.reason}, got[1])
		})
	}
}

// Three epochs: b's r waits for a's, c's for both, and each release comes
// in that order once the copy before it has ended.
func TestHeldRequestsOfOneIDReleaseOldestFirst(t *testing.T) {
	released, system, pid, send, jobs, ja := copyingInEpochA(t)
	send("b", 1, readyChunkOf("r", "h-b", 2)...) // another chunk: b's r stores too
	jb := testkit.Recv(t, jobs, 5*time.Second, "b's store job")
	send("c", 1, append(readyChunkOf("r", "h-c", 3)[:1], messages.Event{Type: messages.EvPreempted, Request: "r"})...)
	statusOf(t, system, pid)
	testkit.NoRecv(t, released, 100*time.Millisecond, "a release while a's and b's copies run")

	system.Root.Send(jb.Owner, &transfer.JobDone{ID: jb.ID}) // b's copy ends first: b still waits for a
	statusOf(t, system, pid)
	testkit.NoRecv(t, released, 100*time.Millisecond, "b's or c's release while a's copy runs")

	system.Root.Send(ja.Owner, &transfer.JobDone{ID: ja.ID})
	var epochs []string
	for range 3 {
		epochs = append(epochs, releaseOf(t, released).Epoch)
	}
	require.Equal(t, []string{"a", "b", "c"}, epochs)
}

func releaseOf(t *testing.T, ch <-chan *nats.Msg) messages.Released {
	t.Helper()
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, ch, 5*time.Second, "a release").Data, &rel))
	return rel
}

// readyChunkOf is readyChunk with the chunk's hash given.
func readyChunkOf(id, hash string, block messages.BlockID) []messages.Event {
	evs := readyChunk(id, block)
	evs[1].Hashes = []messages.Hash{messages.Hash(hash)}
	return evs
}

// epochSender sends the engine actor batches as an engine would publish
// them (epoch, seq, events).
func epochSender(system *actor.ActorSystem, pid *actor.PID) func(epoch string, seq uint64, evs ...messages.Event) {
	return func(epoch string, seq uint64, evs ...messages.Event) {
		system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: epoch, Seq: seq, Events: evs}})
	}
}

// A held request whose actor fails is released (aborted) only once the
// older request of its id is over, as a live one would be: its release is
// of the engine's current epoch, and frees the blocks the older copy reads.
func TestAHeldRequestThatFailsReleasesNothingWhileAnOlderOneCopies(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	system, pid, fs, jobs := startFaulty(t, nc, make(chan struct{}), nil)
	send := epochSender(system, pid)
	send("a", 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "a's r: its store job reads block 1")

	fs.arm.Store(true) // b's r's first decision panics: its actor fails
	send("b", 1, readyChunkOf("r", "h-r2", 1)...)
	statusOf(t, system, pid)
	statusOf(t, system, pid) // after the failure's Terminated and the Drained
	require.False(t, fs.arm.Load(), "b's r failed")
	testkit.NoRecv(t, released, 100*time.Millisecond, "a release of r (epoch b) while a's copy of block 1 runs")

	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	got := []messages.Released{releaseOf(t, released), releaseOf(t, released)}
	require.Equal(t, "a", got[0].Epoch)
	require.Equal(t, messages.Released{Request: "r", Epoch: "b", RSeq: 1, Reason: messages.ReasonAborted}, got[1])
}

// A deferred release keeps its epoch's release count (rseq goes on from
// the epoch's last) even when the epoch ended meanwhile, and goes out
// before a later epoch's request of the id is let go.
func TestADeferredReleaseContinuesItsEpochsRSeq(t *testing.T) {
	released, system, pid, send, _, j := copyingInEpochA(t)
	send("b", 1, added("s"), messages.Event{Type: messages.EvFinished, Request: "s"},
		messages.Event{Type: messages.EvFinished, Request: "r", Computed: 4, Total: 4})
	require.Equal(t, messages.Released{Request: "s", Epoch: "b", RSeq: 1, Reason: messages.ReasonFinished}, releaseOf(t, released))
	send("c", 1, append(readyChunkOf("r", "h-r3", 2)[:1], messages.Event{Type: messages.EvPreempted, Request: "r"})...) // b ends
	statusOf(t, system, pid)
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	got := []messages.Released{releaseOf(t, released), releaseOf(t, released), releaseOf(t, released)}
	require.Equal(t, "a", got[0].Epoch)
	require.Equal(t, messages.Released{Request: "r", Epoch: "b", RSeq: 2, Reason: messages.ReasonFinished}, got[1])
	require.Equal(t, messages.Released{Request: "r", Epoch: "c", RSeq: 1, Reason: messages.ReasonPreempted}, got[2])
}

// On the engine actor's last-resort stop (a failure while failing), a
// failed held request is handed to the transfer side, which releases it;
// an older request of its id ending during the stop does not release it a
// second time.
func TestAHandedOffHeldRequestIsReleasedOnce(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	var gate atomic.Pointer[chan struct{}]
	entered := make(chan struct{}, 1)
	system, pid, fs, jobs := startFaulty(t, nc, closed, func(d *engine.Deps) {
		d.Session = func() uint64 {
			if g := gate.Swap(nil); g != nil {
				entered <- struct{}{}
				<-*g
				panic("engine actor failure injected")
			}
			return 0
		}
		// failing fails too: the actor gives up and stops (handOff)
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
	})
	send := epochSender(system, pid)
	send("a", 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "a's r: its store job")
	fs.arm.Store(true) // b's r fails: held, failed, drained
	send("b", 1, readyChunkOf("r", "h-r2", 1)...)
	statusOf(t, system, pid)
	statusOf(t, system, pid)
	send("c", 1, added("s")) // b's r is retired behind a's r
	statusOf(t, system, pid)
	g := make(chan struct{})
	gate.Store(&g)
	system.Root.Send(pid, &engine.Tick{})
	testkit.Recv(t, entered, 5*time.Second, "the engine actor's turn, held")
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID}) // a's r releases; its Done waits behind the turn
	require.Equal(t, "a", releaseOf(t, released).Epoch)
	close(g)
	testkit.Closed(t, closed, 5*time.Second, "the engine's end")
	require.NoError(t, nc.Flush())
	bs := 0
	for {
		select {
		case m := <-released:
			var rel messages.Released
			require.NoError(t, json.Unmarshal(m.Data, &rel))
			if rel.Request == "r" && rel.Epoch == "b" {
				bs++
			}
			continue
		case <-time.After(300 * time.Millisecond):
		}
		break
	}
	require.Equal(t, 1, bs, "b's r released once")
}

// startFaulty starts engine e1 over a holdingFaultyStore (arm it to make a
// request actor's next store decision panic), its store jobs sent to the
// returned channel and never answered unless the test does; edit sets the
// engine's deps.
func startFaulty(t *testing.T, nc *nats.Conn, closed chan struct{}, edit func(*engine.Deps)) (*actor.ActorSystem,
	*actor.PID, *faultyStore, chan *transfer.Submit) {
	t.Helper()
	fs := holdingFaultyStore(t)
	jobs := make(chan *transfer.Submit, 16)
	system, pid, _, _ := startEngineDeps(t, nc, closed,
		func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
			fs.over(lay)
			d.Store = fs
			d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &submits{ch: jobs} }))
		}, edit)
	return system, pid, fs, jobs
}

// copyingInEpochA starts engine e1 (startSubmitting) and has epoch a's
// request r store its chunk of block 1: j, its copy, runs until the test
// answers it.
func copyingInEpochA(t *testing.T) (released <-chan *nats.Msg, system *actor.ActorSystem, pid *actor.PID,
	send func(epoch string, seq uint64, evs ...messages.Event), jobs chan *transfer.Submit, j *transfer.Submit) {
	t.Helper()
	_, nc := testkit.NATS(t)
	released = testkit.Subscribe(t, nc, "kvactors.e1.released")
	system, pid, jobs = startSubmitting(t, nc, nil)
	send = epochSender(system, pid)
	send("a", 1, readyChunk("r", 1)...)
	return released, system, pid, send, jobs, testkit.Recv(t, jobs, 5*time.Second, "a's r: its store job reads block 1")
}

// A deferred release that goes out lets its epoch go: once nothing of an
// ended epoch may publish any more, its release count is forgotten (each
// ended epoch's count kept would grow the engine's Releases for the boot).
func TestADeferredReleaseLetsItsEndedEpochsCountGo(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var rels *actors.Releases
	system, pid, jobs := startSubmitting(t, nc, func(d *engine.Deps) { rels = d.Releases })
	send := epochSender(system, pid)
	send("a", 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "a's r: its store job")
	send("b", 1, messages.Event{Type: messages.EvFinished, Request: "r", Computed: 4, Total: 4}) // deferred for a's r
	send("c", 1, added("q"))                                                                     // b ends, its release still deferred
	statusOf(t, system, pid)
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	require.Equal(t, "a", releaseOf(t, released).Epoch)
	require.Equal(t, messages.Released{Request: "r", Epoch: "b", RSeq: 1, Reason: messages.ReasonFinished}, releaseOf(t, released))
	statusOf(t, system, pid)
	require.Zero(t, rels.Epochs(), "the ended epochs' release counts are kept")
}

// An epoch that ends with none of its requests left forgets its release
// count at once: nothing of it can publish any more, and each such count
// kept would grow the engine's Releases for the boot.
func TestAnEpochEndingWithNoRequestLeftForgetsItsCount(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var rels *actors.Releases
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) { rels = d.Releases })
	send := epochSender(system, pid)
	send("a", 1, added("r"), messages.Event{Type: messages.EvFinished, Request: "r"}) // released at once: no copy
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonFinished}, releaseOf(t, released))
	statusOf(t, system, pid) // r's Done handled: a has no request left
	require.Equal(t, 1, rels.Epochs(), "a, the live epoch, keeps its count")
	send("b", 1, added("q"))
	statusOf(t, system, pid)
	require.Zero(t, rels.Epochs(), "a ended with no request left: its count is kept")
}

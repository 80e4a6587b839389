package engine_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A request actor that fails owing two releases (its preemption's, waiting
// for a copy, and its end's) is released once, aborted: the engine would
// wait for the second forever. The failure resyncs the epoch, so the
// engine re-announces what it still holds in a new one.
func TestARequestActorFailureResyncsItsEpoch(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	system, pid, fs, jobs := startFaulty(t, nc, make(chan struct{}), nil)
	send := func(seq uint64, evs ...messages.Event) {
		system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "a", Seq: seq, Events: evs}})
	}
	send(1, readyChunk("r", 1)...)
	testkit.Recv(t, jobs, 5*time.Second, "r's store job")
	send(2, messages.Event{Type: messages.EvPreempted, Request: "r"}) // owed 1, waits for the job
	statusOf(t, system, pid)
	testkit.NoRecv(t, resyncs, 50*time.Millisecond, "a resync before any failure")
	fs.arm.Store(true) // the next decision panics
	send(3, messages.Event{Type: messages.EvResumed, Request: "r"},
		messages.Event{Type: messages.EvHashes, Request: "r", Start: 1, Hashes: []messages.Hash{"h2-r"}},
		messages.Event{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{2, 3}},
		tokens("r", 8),
		messages.Event{Type: messages.EvFinished, Request: "r", Computed: 8, Total: 8}) // owed 2

	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the failure's resync").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
	require.Equal(t, messages.ResyncGap, rs.Reason)
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's one release").Data, &rel))
	require.Equal(t, messages.ReasonAborted, rel.Reason)
}

// A request actor that fails while the engine still runs the request (no
// preemption yet) resyncs the epoch too: the node forgets the request once
// its aborted release is out, so a later preemption of it would be
// rejected as unknown and never released.
func TestAFailureBeforeAPreemptionResyncsItsEpoch(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	system, pid, fs, jobs := startFaulty(t, nc, make(chan struct{}), nil)
	send := epochSender(system, pid)
	send("a", 1, readyChunk("r", 1)...)
	testkit.Recv(t, jobs, 5*time.Second, "r's store job")
	fs.arm.Store(true) // r's next decision panics
	send("a", 2, messages.Event{Type: messages.EvHashes, Request: "r", Start: 1, Hashes: []messages.Hash{"h2-r"}},
		messages.Event{Type: messages.EvBlocks, Request: "r", Start: 1, IDs: []messages.BlockID{2}}, tokens("r", 8))
	require.Equal(t, messages.ReasonAborted, releaseOf(t, released).Reason)
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the failure's resync").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
}

// A request actor of an ended epoch that fails (reset, waiting for its
// copy) is released aborted, in its own epoch, and resyncs nothing: the
// engine has moved on, and a resync would end the live epoch for no
// request of it.
func TestAFailureOfAnEndedEpochsRequestResyncsNothing(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	system, pid, jobs := startSubmitting(t, nc, nil)
	send := epochSender(system, pid)
	send("a", 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "a's r: its store job")
	send("b", 1, added("q")) // a's r is reset, and waits for its copy
	statusOf(t, system, pid)
	system.Root.Stop(j.Owner) // a's r ends unreleased: a failure
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted},
		releaseOf(t, released))
	statusOf(t, system, pid)
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, resyncs, 50*time.Millisecond, "a resync for a failure of an ended epoch's request")
}

package node_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

func releasedOf(t *testing.T, ch <-chan *nats.Msg, what string) messages.Released {
	t.Helper()
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, ch, 5*time.Second, what).Data, &rel))
	return rel
}

// A register that replaces an engine's actor (here a new spec over the same
// segment, so the same GPU memory) while the old actor's request r still
// copies block 1: the engine's next epoch re-announces r with block 1,
// preempted (PROTOCOL.md "Resync"), to the new actor. Its release frees
// block 1 for the engine, so it waits until the old actor has ended (no
// copy of it runs): the old epoch's engine_reset of r goes out first, then
// the new epoch's preempted. Released at once, the engine would write
// other KV into block 1 under the old copy, and the chunk stored under r's
// key would hold it: a later load checks the stored bytes are the ones r
// had in block 1.
func TestAReRegisteredEngineReleasesNothingWhileItsOldActorStillCopies(t *testing.T) {
	t.Parallel()
	_, te, dev, released := copyingOldActor(t)
	want := append([]byte(nil), te.block(0, 1)...)
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy of block 1 (epoch ep1)")

	te.spec.OffloadPromptOnly = true
	te.register() // a new actor; the old one's copy still runs
	te.epoch, te.seq = "ep2", 0
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4),
		map[string]any{"type": "preempted", "request": "r"})
	te.sync()
	testkit.NoRecv(t, released, 300*time.Millisecond, "a release while epoch ep1's copy of block 1 still runs")

	dev.gate <- struct{}{}
	require.Equal(t, messages.Released{Request: "r", Epoch: "ep1", RSeq: 1, Reason: messages.ReasonEngineReset},
		releasedOf(t, released, "the old epoch's release of r, once its copy ended"))
	require.Equal(t, messages.Released{Request: "r", Epoch: "ep2", RSeq: 1, Reason: messages.ReasonPreempted},
		releasedOf(t, released, "the new epoch's release of r, after the old actor ended"))

	te.fill(0, 1, 2)                       // the engine reuses block 1, as the release allows
	go func() { dev.gate <- struct{}{} }() // the load's copy
	lr := te.loadInto("l", []string{hash("r", 0)}, 4, []int{5})
	require.True(t, lr.OK, lr.Error)
	require.Equal(t, want, te.block(0, 5), "the chunk stored under r's key holds what r had in block 1")
}

// Releases are numbered per engine and epoch for the whole boot (rseq), also
// across a re-register: the new actor, which saw epoch ep1 end, keeps its
// count while the old actor may still publish ep1 releases, so r's
// engine_reset after q's release is ep1's second, and the heartbeat of ep1
// reports both.
func TestAnEpochsRSeqGoesOnAcrossAReRegister(t *testing.T) {
	t.Parallel()
	_, te, dev, released := copyingOldActor(t)
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4),
		added("q", 4), finishedEv("q", false, 0, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy of block 1 (epoch ep1)")
	require.Equal(t, messages.Released{Request: "q", Epoch: "ep1", RSeq: 1, Reason: messages.ReasonFinished},
		releasedOf(t, released, "q's release"))

	te.spec.OffloadPromptOnly = true
	te.register() // the old actor retires: r's engine_reset (ep1) waits for its copy
	te.heartbeat("ep1", 1)
	te.epoch, te.seq = "ep2", 0
	te.send(added("z", 4)) // ep1 ends for the new actor
	te.sync()
	dev.gate <- struct{}{}
	require.Equal(t, messages.Released{Request: "r", Epoch: "ep1", RSeq: 2, Reason: messages.ReasonEngineReset},
		releasedOf(t, released, "r's engine_reset release"), "the second release of epoch ep1 carries rseq 2")
}

// The engine's next actor, retired before its predecessor ended (here the
// engine unregisters), holding only a deferred release (a finished for r,
// which it never knew): neither that release nor the unregister's reply
// goes out while the predecessor's copy of r's block 1 still runs. Once it
// ends: the old epoch's engine_reset of r, the new epoch's finished, then
// the reply.
func TestAnUnregisterWhileTheOldActorStillCopiesWaitsForIt(t *testing.T) {
	t.Parallel()
	e, te, dev, released := copyingOldActor(t)
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy of block 1 (epoch ep1)")

	te.spec.OffloadPromptOnly = true
	te.register() // a new actor; the old one's copy still runs
	te.epoch, te.seq = "ep2", 0
	te.send(finishedEv("r", false, 4, 4)) // r is unknown to the new actor: its release deferred
	te.sync()

	unregistered := make(chan *nats.Msg, 1)
	go func() {
		if m, err := testkit.EngineRequest(e.nc, "e1", "kvactors.e1.unregister", []byte(`{}`), 10*time.Second); err == nil {
			unregistered <- m
		}
	}()
	testkit.NoRecv(t, released, 300*time.Millisecond, "a release while epoch ep1's copy of block 1 still runs")
	testkit.NoRecv(t, unregistered, 0, "the unregister's reply while epoch ep1's copy still runs")

	dev.gate <- struct{}{}
	require.Equal(t, messages.Released{Request: "r", Epoch: "ep1", RSeq: 1, Reason: messages.ReasonEngineReset},
		releasedOf(t, released, "the old epoch's release of r"))
	require.Equal(t, messages.Released{Request: "r", Epoch: "ep2", RSeq: 1, Reason: messages.ReasonFinished},
		releasedOf(t, released, "the new epoch's deferred release of r"))
	testkit.Recv(t, unregistered, 5*time.Second, "the unregister's reply, once the old actor ended")
}

// copyingOldActor is a node whose copies wait for dev.gate, with engine e1
// registered and block 1 filled; released sees its raw releases.
func copyingOldActor(t *testing.T) (*env, *testEngine, *heldDevice, <-chan *nats.Msg) {
	t.Helper()
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	e := startNode(t, func(c *node.Config) { c.WrapDevice = dev.wrap })
	te := e.newEngine("e1", defaultOpts())
	released := testkit.Subscribe(t, e.nc, "kvactors.e1.released")
	te.register()
	te.fill(0, 1, 1)
	return e, te, dev, released
}

package engine_test

import (
	"context"
	"encoding/json"
	"sync"
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
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// A request reset with nothing to release (preempted and released before
// the engine reset) is done all the same: an end of its actor before its
// Done is handled is no failure to release it for, aborted. That release
// would be one the engine never asked for, and could free the blocks of a
// later request that reuses the id.
func TestARequestResetWithNothingToReleaseIsNotReleasedWhenItsActorEnds(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	xfer := &submits{ch: make(chan *transfer.Submit, 16), drains: make(chan *transfer.Drain, 16)}
	var xferPID *actor.PID
	system, pid, _, _ := startEngineWith(t, nc, make(chan struct{}), func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
			Engine("e1", lay, testkit.NopDevice{})
		xferPID = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return xfer }))
		d.Transfer = xferPID
	})
	sendBatch(system, pid, 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, xfer.ch, 5*time.Second, "r's store job")
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	sendBatch(system, pid, 2, messages.Event{Type: messages.EvPreempted, Request: "r"})
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's preemption released").Data, &rel))
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonPreempted}, rel)

	// Epoch b begins: r is reset, owes nothing (its blocks were given
	// back), and is done; its Done waits behind the turn, held.
	holding, gate := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	letGo := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(letGo)
	go system.Root.Send(pid, &engine.Batch{Ctx: context.Background(),
		Batch: messages.EventBatch{Epoch: "b", Seq: 1}, Done: actors.SignalFunc(func() {
			holding <- struct{}{}
			<-gate
		})})
	testkit.Recv(t, holding, 5*time.Second, "the engine held in the turn that reset r")
	system.Root.Stop(j.Owner) // r is idle: its Terminated is queued ahead of its Done
	letGo()

	statusOf(t, system, pid) // after the Terminated and the Done
	done := make(chan struct{}, 1)
	system.Root.Send(xferPID, probe{done: done})
	testkit.Recv(t, done, 5*time.Second, "the transfer actor's probe")
	select {
	case d := <-xfer.drains:
		t.Fatalf("r's end taken for a failure: its copies drained (%v) for an aborted release", d.Owner)
	default:
	}
	require.NoError(t, nc.Flush())
	select {
	case m := <-released:
		t.Fatalf("a release r does not owe: %s", m.Data)
	default:
	}
}

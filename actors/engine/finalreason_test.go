package engine_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A request that released finished just before its engine actor failed is
// not in the retire's count when the actor gives up: its Terminated comes
// before its Done (the stop is a system message), and its release was not
// the retire's (engine_gone). The count reaches the node (Deps.Failed) and
// an unregister's "released N" (PROTOCOL.md "P.E.unregister").
func TestAGivenUpEngineActorDoesNotCountAFinishedRelease(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFailing(t, nc)
	j := f.storeInFlight(t)
	sendBatch(f.system, f.pid, 2, messages.Event{Type: messages.EvFinished, Request: "r", Computed: 4, Total: 4})
	statusOf(t, f.system, f.pid)

	gate := make(chan struct{})
	f.nowGate.Store(&gate)
	f.system.Root.Send(f.pid, &engine.Touch{}) // holds the actor in its turn
	testkit.Recv(t, f.nowEntered, 5*time.Second, "the held turn")
	for range 12 {
		f.system.Root.Send(f.pid, &engine.Touch{})
	}
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	f.system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID}) // r is released; its Done queues behind the Touches
	require.Equal(t, messages.ReasonFinished, recvRelease(t, released, "r's release once its copy is done").Reason)
	f.nowFails.Store(13) // the held turn fails (the retire marks r), and each Touch after it
	close(gate)
	rep := testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report")
	testkit.Closed(t, f.closed, 5*time.Second, "the stop of the engine actor failing again and again")
	require.Equal(t, 0, testkit.Recv(t, rep.released, 5*time.Second, "the retire's count"),
		"r released finished, not engine_gone")
	require.Zero(t, testutilValue(f.m), "r, released and stopped with its engine actor, did not fail")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
}

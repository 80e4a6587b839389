package engine_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// An added refused for --max-requests is not reported to the engine (a
// batch has no reply), which goes on with the request and waits for a
// release per preemption and one for its finish (PROTOCOL.md: released is
// published exactly once per such event). So a preempted of such a request
// is answered like its finished, each once; a preempted of a request never
// announced is rejected as before.
func TestEveryPreemptionAndTheFinishOfALimitRefusedRequestAreAnswered(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) { d.MaxRequests = 1 })
	send := epochSender(system, pid)
	preempted := func(id string) messages.Event { return messages.Event{Type: messages.EvPreempted, Request: id} }
	send("a", 1, added("a1"))
	send("a", 2, readyChunk("b", 2)...) // b's added is refused: the limit
	send("a", 3, preempted("b"), messages.Event{Type: messages.EvResumed, Request: "b"}, preempted("b"),
		messages.Event{Type: messages.EvFinished, Request: "b", Computed: 4, Total: 4}, preempted("never"))
	statusOf(t, system, pid)
	var got []messages.Released
	for range 3 {
		got = append(got, releaseOf(t, released))
	}
	require.Equal(t, []messages.Released{
		{Request: "b", Epoch: "a", RSeq: 1, Reason: messages.ReasonPreempted},
		{Request: "b", Epoch: "a", RSeq: 2, Reason: messages.ReasonPreempted},
		{Request: "b", Epoch: "a", RSeq: 3, Reason: messages.ReasonFinished},
	}, got)
	testkit.NoRecv(t, released, 100*time.Millisecond, "a release of a request never announced")
}

package engine_test

import (
	"fmt"
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

// The refused ids follow the same rules as live requests: a second
// preempted before resumed is ignored; a preempted in a later epoch that
// has not announced the id is rejected (only the epoch an id was refused in
// counts); and the last 4,096 refused ids are always remembered.
func TestRefusedRequestsFollowThePreemptionRules(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) { d.MaxRequests = 1 })
	send := epochSender(system, pid)
	preempted := func(id string) messages.Event { return messages.Event{Type: messages.EvPreempted, Request: id} }
	evs := []messages.Event{added("a1")}
	for i := range 4097 { // refused: the limit is one live request
		evs = append(evs, added(fmt.Sprintf("r%d", i)))
	}
	send("a", 1, evs...)
	send("a", 2, preempted("b0"), preempted("r4096"), preempted("r4096"), preempted("r1"))
	send("c", 1, added("a1"), preempted("r2")) // c has not announced r2
	statusOf(t, system, pid)
	got := []messages.Released{releaseOf(t, released), releaseOf(t, released)}
	require.ElementsMatch(t, []messages.Released{
		{Request: "r4096", Epoch: "a", RSeq: got[0].RSeq, Reason: messages.ReasonPreempted},
		{Request: "r1", Epoch: "a", RSeq: got[1].RSeq, Reason: messages.ReasonPreempted},
	}, got, "r4096's first preempted and r1's (refused 4,096 ids before the last) are answered")
	// a1 of epoch a is reset by c (no blocks: no release); nothing else.
	testkit.NoRecv(t, released, 100*time.Millisecond, "a second preempted, one of a never-announced id, or one of another epoch answered")
}

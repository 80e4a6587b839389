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

// A batch taken before a silence of its engine ended (stamped with the
// hearing generation then) but handled after (it waited in the engine
// actor's mailbox behind a slow turn) begins its epoch in that older
// generation: it does not resume the engine's loads, which the silence
// refuses until an epoch begun after it, and its requests' copies carry
// the older generation, so they never start. It resumed loads and gave
// its copies the generation of when it was handled.
func TestAnEpochBegunByABatchTakenBeforeASilenceBelongsToItsGeneration(t *testing.T) {
	_, nc := testkit.NATS(t)
	h := &transfer.Hearing{}
	system, pid, jobs := startSubmitting(t, nc, func(d *engine.Deps) { d.Request.Hearing = h })
	batch := func(epoch string, hearing uint64, evs []messages.Event) *engine.Batch {
		return &engine.Batch{Batch: messages.EventBatch{Epoch: epoch, Seq: 1, Events: evs}, Stamped: true, HearingGen: hearing}
	}
	taken := h.Gen() // the batch is taken: generation 0
	h.Silenced()     // then the engine's silence ends (the next message), before the actor gets to the batch
	system.Root.Send(pid, batch("a", taken, readyChunk("r", 1)))
	j := testkit.Recv(t, jobs, 5*time.Second, "r's store job")
	require.Equal(t, taken, j.HearingGen, "the copy carries the generation the batch was taken in")
	require.True(t, h.LoadsRefused(), "an epoch begun before the silence ended resumed the engine's loads")

	system.Root.Send(pid, batch("b", h.Gen(), readyChunk("n", 2))) // the engine's epoch after the silence
	j2 := testkit.Recv(t, jobs, 5*time.Second, "n's store job")
	require.Equal(t, h.Gen(), j2.HearingGen)
	require.False(t, h.LoadsRefused(), "an epoch begun after the silence resumes the loads")
}

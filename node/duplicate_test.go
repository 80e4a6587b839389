package node_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "EventBatch": "A batch with seq ≤ the last applied is a
// duplicate and ignored" (docs/PROTOCOL.md: counted in
// kvactors_events_duplicate_batches_total); kvactors' choice: a batch or
// heartbeat of an epoch that ended is late, and never ends the live epoch
// (counted with the duplicates). Each batch below would change the
// engine's requests if it were applied; none does, none resyncs, and each
// is counted.
func TestDuplicateAndLateBatchesAreIgnoredAndCounted(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	batch := func(epoch string, seq uint64, events ...map[string]any) {
		te.sendRaw(map[string]any{"epoch": epoch, "seq": seq, "events": events})
	}
	dups := func() float64 { return metricValue(t, e.reg, "kvactors_events_duplicate_batches_total", nil) }
	requests := func() []string {
		st := te.sync()
		var got []string
		for _, r := range st.Requests {
			got = append(got, r.Request)
		}
		return got
	}

	batch("ep1", 1, added("a", 8), blocksEv("a", 0, 0, 1))
	batch("ep1", 2, added("b", 8))
	batch("ep1", 2, added("dup2", 8))                               // seq = last applied
	batch("ep1", 1, added("dup1", 8), finishedEv("a", false, 0, 8)) // seq below it
	require.ElementsMatch(t, []string{"a", "b"}, requests(), "a duplicate changed the requests")
	st := te.sync()
	require.Equal(t, "ep1", st.Epoch)
	require.Equal(t, uint64(2), st.Seq)
	require.False(t, st.Resyncing)
	require.Equal(t, 2.0, dups())

	batch("ep2", 1, added("c", 8), blocksEv("c", 0, 0, 2))
	require.Equal(t, messages.Released{Request: "a", Reason: messages.ReasonEngineReset}, recv(t, te.released, "a reset"))
	// Late: ep1 ended. Neither its next seq nor a jump (a gap, were ep1
	// live) nor a heartbeat naming a lost tail ends ep2 or resyncs.
	batch("ep1", 3, added("late3", 8))
	batch("ep1", 9, added("late9", 8))
	hb := te.heartbeat("ep1", 9)
	require.Empty(t, hb.Error)
	require.Zero(t, hb.Applied, "ep1 is not live")
	require.Equal(t, []string{"c"}, requests())
	st = te.sync()
	require.Equal(t, "ep2", st.Epoch)
	require.Equal(t, uint64(1), st.Seq)
	require.False(t, st.Resyncing)
	require.Equal(t, 4.0, dups(), "late batches are counted with the duplicates")
	none(te, te.resync, "a resync for a duplicate or late batch")

	batch("ep2", 2, finishedEv("c", false, 0, 8))
	require.Equal(t, messages.Released{Request: "c", Reason: messages.ReasonFinished}, recv(t, te.released, "c finished"))
	none(te, te.released, "a release of b (no blocks) or of a late batch's request")
}

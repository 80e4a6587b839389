package node_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/messages"
)

// An engine that cycles register, a new epoch, a release and unregister
// does not grow the node: the release numbering the node keeps for the
// engine id across registers is that of its most recently released epochs
// (actors.KeptEpochs), the oldest forgotten, the latest going on.
func TestAnEngineCyclingEpochsKeepsOnlyItsRecentReleaseCounts(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	const cycles = actors.KeptEpochs + 4
	for i := range cycles {
		te.register()
		te.epoch, te.seq = fmt.Sprintf("epoch%03d", i), 0
		te.send(finishedEv("ghost", true, 0, 0)) // unknown: released at once, in this epoch
		recv(t, te.released, "the release")
		var u messages.UnregisterReply
		require.NoError(t, jsonUnmarshal(te.request("unregister", map[string]any{}), &u))
		require.True(t, u.OK, u.Error)
	}
	te.register()
	require.Equal(t, uint64(0), te.heartbeat("epoch000", 1).Released, "the least recently released epoch is forgotten")
	require.Equal(t, uint64(1), te.heartbeat(fmt.Sprintf("epoch%03d", cycles-1), 1).Released,
		"the latest epoch's count is kept across the unregister")
}

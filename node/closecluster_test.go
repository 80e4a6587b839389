package node_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// Close unmaps the pool after closeCluster, so it returns only once what
// copies into or out of the pool through the cluster has ended: a remote
// load's fetch (held as it allocates a chunk's room, past the cancel Close
// sends it) and a fetch being served (held in readChunk). Each is reached
// through its real entry point (a load message, the fetch server); the
// seam only holds it there.
func TestCloseWaitsForARemoteLoadsFetchAndAFetchBeingServed(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	a := kc.engineOn(0, "ea", "m")
	b := kc.engineOn(1, "eb", "m")
	c := kc.engineOn(2, "ec", "m")
	a.register()
	b.register()
	c.register()
	hs := []string{hash("w", 0), hash("w", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A")
	awaitLookup(t, b, hs, 8, "B")
	awaitLookup(t, c, hs, 8, "C")
	load := func(te *testEngine, req string) {
		_ = collect(t, te.e.nc, "kvactors."+te.id+".load",
			map[string]any{"request": req, "hashes": hs, "num_tokens": 8, "blocks": [][]int{{2, 3}}})
	}
	closeWhileHeld := func(i int, entered <-chan struct{}, release func(), what string) {
		t.Helper()
		testkit.Closed(t, entered, 10*time.Second, what+" held")
		closed := make(chan error, 1)
		go func() { closed <- kc.nodes[i].node.Close(context.Background()) }()
		testkit.NoRecv(t, closed, 300*time.Millisecond, "Close's return while "+what+" is held")
		release()
		require.NoError(t, testkit.Recv(t, closed, 10*time.Second, "Close's return once "+what+" ends"))
	}

	// B's load fetches from A; B closes while its fetch is held.
	fetching, release := kc.nodes[1].node.HoldInClusterGate("fetch")
	load(b, "rb")
	closeWhileHeld(1, fetching, release, "B's remote load's fetch")

	// C's load fetches from A; A closes while it serves the fetch.
	serving, release := kc.nodes[0].node.HoldInClusterGate("read")
	load(c, "rc")
	closeWhileHeld(0, serving, release, "the fetch A serves")
}

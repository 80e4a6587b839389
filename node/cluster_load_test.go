package node_test

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A load whose prefix is partly in the local pool and partly held by
// another node makes room for the remote chunks without evicting its own
// local ones: they are offered with the remote keys, and an offered key is
// never evicted for its siblings. Before, in a full pool the room was made
// by evicting the load's own chunk 0, and the load failed as a miss after
// fetching, though lookup counted every chunk.
func TestClusterRemoteLoadKeepsItsOwnLocalPrefix(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2, func(i int, c *node.Config) {
		if i == 1 {
			c.PoolBytes = 512 // two 256-byte chunks
		}
	})
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(1, "ec", "m")
	a.register()
	c.register()
	hs := []string{hash("x", 0), hash("x", 1)}
	a.fill(0, 41, 7)
	// A stores chunk 1 only (chunk 0's block is the null block).
	a.send(added("r", 8), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 0, 41), tokensEv("r", 8, 8))
	recv(t, a.stored, "stored by A")
	// C holds chunk 0 of the prefix itself (the older of its two), and one
	// other chunk: its pool is full.
	c.fill(0, 10, 7)
	c.send(added("c0", 4), hashesEv("c0", 0, hs[0]), blocksEv("c0", 0, 0, 10), tokensEv("c0", 4, 4))
	recv(t, c.stored, "chunk 0 stored by C")
	c.storeOne("other", 11)
	awaitLookup(t, c, hs, 8, "C") // chunk 0 only in C's own pool, chunk 1 only on A
	r := c.loadInto("rc", hs, 8, []int{2, 3})
	require.True(t, r.OK, "lookup counted 8 tokens, every chunk is loadable, the load failed: %s", r.Error)
	require.Equal(t, 1, r.RemoteChunks)
	require.True(t, bytes.Equal(c.block(0, 10), c.block(0, messages.BlockID(2))), "chunk 0 from C's pool")
	require.True(t, bytes.Equal(a.block(0, 41), c.block(0, messages.BlockID(3))), "chunk 1 from A")
}

// Loads that need a remote fetch count in the engine's loads in flight
// (node.MaxCopyingLoads) from before their fetch goroutine starts: past the
// bound a load is answered "node overloaded" at once and starts nothing.
// Before, the bound applied only once the fetch was done, so one engine
// could start a goroutine (and its fetches, and their pool room) per load
// without limit. Every remote load is held as its goroutine starts; the
// engine's loads are handled in the order sent, so MaxCopyingLoads are held
// and the one past them is answered while they wait; let go, each is
// answered.
func TestClusterRemoteLoadsFetchingAreBounded(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(1, "ec", "m")
	a.register()
	c.register()
	hs := []string{hash("f", 0), hash("f", 1)}
	a.storePrefix("r", hs, 1, 2, 3, "stored by A")
	awaitLookup(t, c, hs, 8, "C")

	entered, release := kc.nodes[1].node.HoldAllInClusterGate("remote-load", node.MaxCopyingLoads+1)
	defer release()
	replies := floodLoads(t, c.e.nc, "ec", hs, 8, []int{5, 6})
	for range node.MaxCopyingLoads {
		testkit.Recv(t, entered, 10*time.Second, "a remote load's goroutine")
	}
	requireOverloadedFirst(t, replies)
	require.Empty(t, entered, "a remote load past the bound started its fetch")
	require.Equal(t, 1.0, kc.nodes[1].counter("kvactors_events_rejected_total", "limit"))

	// Let go, each held load is answered: one fetches, the others wait for
	// its pending chunks (past the waiting bound, a miss at once).
	release()
	ok := 0
	for range node.MaxCopyingLoads {
		var r messages.LoadReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 20*time.Second, "a held load's answer").Data, &r))
		require.NotContains(t, r.Error, messages.Overloaded)
		if r.OK {
			ok++
		}
	}
	require.Positive(t, ok)
}

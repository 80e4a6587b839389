package node_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// The holder evicts a key between another node's lookup (which counted it)
// and that node's fetch of it: the fetch is refused naming the key, the
// load fails as a miss with no byte written to the engine's blocks, and
// the room it reserved is freed (the engine stores the prefix itself).
func TestClusterHolderEvictingBetweenLookupAndLoadFailsTheLoadAsAMiss(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2, func(i int, c *node.Config) {
		if i == 0 {
			c.PoolBytes = 512 // two 256-byte chunks: two more stores evict the prefix
		}
	})
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(1, "ec", "m")
	a.register()
	c.register()
	hs := []string{hash("v", 0), hash("v", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A")
	awaitLookup(t, c, hs, 8, "C")

	serving, release := kc.nodes[0].node.HoldInClusterGate("read")
	defer release()
	before := append([]byte(nil), c.block(0, 2)...)
	replies := collect(t, c.e.nc, "kvactors.ec.load",
		map[string]any{"request": "rc", "hashes": hs, "num_tokens": 8, "blocks": [][]int{{2, 3}}})
	testkit.Closed(t, serving, 10*time.Second, "A serving C's fetch, held")
	a.storeOne("x1", 50) // A's pool holds two chunks: these two evict the prefix
	a.storeOne("x2", 51)
	release()

	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "C's load reply").Data, &r))
	require.False(t, r.OK, "the key the lookup counted was evicted before the fetch read it")
	// The first chunk that failed is named (either: they are fetched at once).
	require.Regexp(t, hs[0]+"|"+hs[1], r.Error, "the error names the key")
	require.Equal(t, before, c.block(0, 2), "no byte reached the engine's block")
	require.Positive(t, kc.nodes[1].counter("kvactors_cluster_fetch_failures_total", ""))
	awaitLookup(t, c, hs, 0, "C, once A's BlockRemoved arrived")
	c.storePrefix("own", hs, 10, 11, 3, "stored by C after the failed fetch: its reserved room was freed")
}

// A register whose spec has CUDA memory and names no node is refused by
// every node of a cluster alike, before any claim, whatever the nodes'
// backend (here shm): no node can tell which host a CUDA IPC handle is from
// (TestCUDAClusterRefusesAnEngineNamingNoNode runs it on cuda nodes).
func TestClusterRefusesAnUnnamedCUDAEngineOnEveryNode(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	te := kc.nodes[0].newEngine("gpuengine", defaultOpts())
	spec := te.spec
	spec.Segments = []messages.Segment{{CUDAIPC: strings.Repeat("00", 64), Bytes: 64 * 256}}
	replies := collect(t, kc.nodes[0].nc, "kvactors.gpuengine.register", spec)
	from := map[string]bool{}
	for range kc.nodes {
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "a refusal").Data, &r))
		require.False(t, r.OK)
		require.Contains(t, r.Error, "must name its node")
		from[r.Node] = true
	}
	require.Len(t, from, 2, "refused by every node")
	testkit.NoRecv(t, replies, 200*time.Millisecond, "a third answer")
	for _, e := range kc.nodes {
		require.Empty(t, e.node.Engines(), "nothing claimed on %s", e.node.NodeID())
	}
}

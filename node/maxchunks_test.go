package node_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// An engine's spec chooses its chunk size (PROTOCOL.md: the pool takes
// any), and one-byte chunks would fill a pool's bytes with as many
// entries, ~170 bytes of heap each: a 1 GiB pool with a billion of them
// is ~170 GB, the node OOMs and every tenant loses it. --pool-max-chunks
// bounds them: an engine storing ten times the cap in one-byte chunks
// keeps storing, each store past the cap evicting as one past the bytes
// does, and the pool never holds more than the cap.
func TestTinyChunksAreBoundedByPoolMaxChunks(t *testing.T) {
	t.Parallel()
	const maxChunks, requests, perRequest = 16, 4, 40
	e := startNode(t, func(c *node.Config) { c.PoolMaxChunks = maxChunks })
	o := defaultOpts()
	o.blockBytes, o.blocks = 1, 1+requests*perRequest
	te := e.newEngine("tiny", o)
	te.register()
	for r := range requests {
		req := fmt.Sprintf("r%d", r)
		hs := make([]string, perRequest)
		ids := make([]int, perRequest)
		for i := range hs {
			hs[i] = hash(req, i)
			ids[i] = 1 + r*perRequest + i
			te.fill(0, messages.BlockID(ids[i]), 1)
		}
		te.send(added(req, 4*perRequest), hashesEv(req, 0, hs...), blocksEv(req, 0, 0, ids...),
			tokensEv(req, 4*perRequest, 4*perRequest))
	}
	stored := 0
	for stored < requests*perRequest {
		s := recv(t, te.stored, fmt.Sprintf("stored (%d of %d chunks so far)", stored, requests*perRequest))
		require.LessOrEqual(t, len(s.Chunks), maxChunks, "a decision is capped to what the pool holds")
		stored += len(s.Chunks)
	}
	st := te.sync()
	require.Equal(t, maxChunks, st.Pool.MaxChunks)
	require.LessOrEqual(t, st.Pool.Used, maxChunks, "the pool holds at most --pool-max-chunks")
	require.Less(t, st.Pool.Data, int64(requests*perRequest), "its bytes held every chunk: the cap evicted")
	require.GreaterOrEqual(t, metricValue(t, e.reg, "kvactors_pool_evictions_total", nil),
		float64(requests*perRequest-maxChunks))
	require.Equal(t, float64(maxChunks), metricValue(t, e.reg, "kvactors_pool_max_chunks", nil))
}

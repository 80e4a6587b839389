package node_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// kvactors' choice (docs/PROTOCOL.md, "block id 0"): a chunk of a group that
// is not full attention is not stored while any of its blocks is null. Here
// a sliding window of 6 tokens, 4 tokens a block, 2 blocks a chunk: request
// r computed 12 tokens with group 1's first block null (out of its window),
// so its chunk 0 of group 1 is [null, 6]. A lookup for 8 tokens needs
// tokens [2, 8) of group 1, block 0 included: stored, the chunk would have
// answered 8 and a load would have copied zeros into block 0's place. It
// answers 0, the load fails and writes nothing; a later whole copy of the
// chunk (request r2) is stored, not deduplicated against a partial one, and
// then loads its own bytes.
func TestASlidingWindowChunkWithANullBlockIsNotCountedNorLoaded(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	o := defaultOpts()
	o.bpc, o.tpb, o.kinds, o.window = 2, []int{4, 4}, []string{"full", "sliding_window"}, 6
	te := e.newEngine("e1", o)
	te.register()
	hs := []string{hash("sw", 0), hash("sw", 1), hash("sw", 2)}
	for _, b := range []int{1, 2, 3} {
		te.fill(0, messages.BlockID(b), 1)
	}
	for _, b := range []int{5, 6, 7} {
		te.fill(1, messages.BlockID(b), 1)
	}
	te.send(added("r", 12), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 1, 2, 3), blocksEv("r", 1, 0, 0, 6, 7),
		tokensEv("r", 12, 12), finishedEv("r", false, 12, 12))
	st := recv(t, te.stored, "r's chunks")
	recv(t, te.released, "r released")
	require.Equal(t, 0, te.lookup(hs[:2]), "group 1 does not back 8 tokens: tokens [2, 4) were a null block")

	te.fill(1, 12, 9)
	before := append([]byte(nil), te.block(1, 12)...)
	r := te.loadInto("l1", hs[:2], 8, []int{10, 11}, []int{12, 13})
	require.False(t, bytes.Equal(make([]byte, len(before)), te.block(1, 12)), "needed block 12 loaded as zeros")
	require.False(t, r.OK, "a load of 8 tokens needs group 1's chunk 0")
	require.Equal(t, before, te.block(1, 12), "a failed load writes nothing")
	for _, c := range st.Chunks {
		require.Zero(t, c.Group, "only group 0's chunk is stored: group 1's chunk 0 has a null block")
	}

	te.send(added("r2", 8), hashesEv("r2", 0, hs[:2]...), blocksEv("r2", 0, 0, 1, 2), blocksEv("r2", 1, 0, 5, 6),
		tokensEv("r2", 8, 8), finishedEv("r2", false, 8, 8))
	st = recv(t, te.stored, "r2's whole chunk")
	require.Len(t, st.Chunks, 1)
	require.Equal(t, 1, st.Chunks[0].Group)
	recv(t, te.released, "r2 released")
	require.Equal(t, 8, te.lookup(hs[:2]))
	r = te.loadInto("l2", hs[:2], 8, []int{10, 11}, []int{12, 13})
	require.True(t, r.OK, r.Error)
	for i, b := range []int{5, 6} {
		got := te.block(1, messages.BlockID(12+i))
		require.False(t, bytes.Equal(make([]byte, len(got)), got), "block %d loaded as zeros", 12+i)
		require.Equal(t, te.block(1, messages.BlockID(b)), got, "block %d is r2's block %d", 12+i, b)
	}
}

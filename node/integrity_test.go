package node_test

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// PROTOCOL.md "Integrity": a chunk whose bytes changed in host memory after
// it was stored is never loaded. The load fails with an error naming the
// key, no byte of it (nor of the healthy chunk before it) reaches the
// engine's blocks, the chunk is dropped (BlockRemoved, lookup misses) and
// counted.
func TestCorruptChunkInHostMemoryIsNeverLoaded(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.fill(0, 1, 3)
	te.fill(0, 2, 3)
	hs := []string{hash("crc", 0), hash("crc", 1)}
	te.send(added("a", 8), hashesEv("a", 0, hs...), blocksEv("a", 0, 0, 1, 2), tokensEv("a", 8, 8))
	recv(t, te.stored, "prefix stored")
	recv(t, te.kv, "BlockStored")
	require.Equal(t, 8, te.lookup(hs))

	// Flip one byte of chunk 1's copy in the pool: find it by its bytes.
	arena := e.node.Arena().Bytes()
	at := bytes.Index(arena, te.block(0, 2))
	require.GreaterOrEqual(t, at, 0, "chunk 1's bytes are in the pool")
	arena[at+17] ^= 0x40

	te.fill(0, 20, 9)
	te.fill(0, 21, 9)
	dst0, dst1 := bytes.Clone(te.block(0, 20)), bytes.Clone(te.block(0, 21))
	r := te.loadInto("b", hs, 8, []int{20, 21})
	require.False(t, r.OK)
	require.Contains(t, r.Error, fmt.Sprintf("%x", mustHex(hs[1])), "the error names the corrupt key")
	require.Contains(t, r.Error, "checksum mismatch")
	require.Equal(t, dst0, te.block(0, 20), "nothing was copied: the healthy chunk shares the corrupt one's tile")
	require.Equal(t, dst1, te.block(0, 21), "nothing was copied: not the corrupt chunk")

	removed := recv(t, te.kv, "BlockRemoved for the corrupt chunk")
	require.Equal(t, messages.KVBlockRemoved, removed.Events[0].Type)
	require.Equal(t, []string{hs[1]}, removed.Events[0].BlockHashes)
	require.Equal(t, 4, te.lookup(hs), "the corrupt chunk is gone; the healthy one stays")
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_pool_corrupt_chunks_total", nil))
	require.Zero(t, te.sync().Pool.Pinned, "the failed load unpinned its keys")

	// The healthy chunk still loads, byte for byte.
	r = te.loadInto("c", hs[:1], 4, []int{22})
	require.True(t, r.OK, r.Error)
	require.Equal(t, te.block(0, 1), te.block(0, 22))
}

// Issue 12: engines with different chunk sizes share one pool (no size is
// fixed by the first engine). Three engines, chunks of 256 B, 8 KiB and
// 2 MiB (four 512 KiB blocks), store and load back byte-identically.
func TestMixedChunkSizesFromThreeEngines(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.PoolBytes = 16 << 20 })
	type eng struct {
		te  *testEngine
		bpc int
	}
	var engines []eng
	for i, o := range []engineOpts{
		{tph: 4, bpc: 1, blocks: 17, tpb: []int{4}, blockBytes: 256},
		{tph: 4, bpc: 2, blocks: 17, tpb: []int{4}, blockBytes: 4 << 10},
		{tph: 4, bpc: 4, blocks: 17, tpb: []int{4}, blockBytes: 512 << 10},
	} {
		te := e.newEngine(fmt.Sprintf("e%d", i), o)
		te.register() // the second and third are not refused for their larger chunks
		engines = append(engines, eng{te, o.bpc})
	}
	for i, en := range engines {
		te, bpc := en.te, en.bpc
		src := make([]int, 2*bpc) // two chunks from blocks 1..2*bpc
		for j := range src {
			src[j] = 1 + j
			te.fill(0, messages.BlockID(src[j]), byte(i+1))
		}
		hs := make([]string, 2*bpc)
		for j := range hs {
			hs[j] = hash(fmt.Sprintf("m%d", i), j)
		}
		tokens := 4 * 2 * bpc
		te.send(added("a", tokens), hashesEv("a", 0, hs...), blocksEv("a", 0, 0, src...), tokensEv("a", tokens, tokens))
		st := recv(t, te.stored, "engine "+te.id+" stored")
		require.Len(t, st.Chunks, 2)
		require.Equal(t, tokens, te.lookup(hs))
	}
	for _, en := range engines { // load after every engine stored: nothing overwrote another's bytes
		te, bpc := en.te, en.bpc
		hs := make([]string, 2*bpc)
		for j := range hs {
			hs[j] = hash(fmt.Sprintf("m%s", te.id[1:]), j)
		}
		dst := make([]int, 2*bpc)
		for j := range dst {
			dst[j] = 9 + j // blocks 9..16: past every source block
		}
		r := te.loadInto("b", hs, 4*2*bpc, dst)
		require.True(t, r.OK, "engine %s: %s", te.id, r.Error)
		for j := range dst {
			require.True(t, bytes.Equal(te.block(0, messages.BlockID(1+j)), te.block(0, messages.BlockID(dst[j]))),
				"engine %s block %d comes back byte-identical", te.id, j)
		}
	}
	st := engines[0].te.sync().Pool
	require.Equal(t, 6, st.Ready)
	require.Equal(t, int64(2*256+2*8<<10+2*2<<20), st.Data)
}

// Only a chunk larger than the whole pool is refused at register (no slot
// size is fixed by an earlier engine); the error says why.
func TestChunkLargerThanPoolRefused(t *testing.T) {
	t.Parallel()
	e := startNode(t, withPoolSlots(2)) // 512 bytes
	small := e.newEngine("small", defaultOpts())
	small.register()
	o := defaultOpts()
	o.blockBytes = 1024
	big := e.newEngine("big", o)
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(big.request("register", big.spec), &reply))
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, "chunk of 1024 bytes is larger than the pool")
	o.blockBytes = 512 // twice the first engine's chunk, the whole pool: accepted
	fits := e.newEngine("fits", o)
	fits.register()
}

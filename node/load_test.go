package node_test

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A key evicted to make room answers a load with an error naming it as
// P.E.stored announced it (hash, then group; never the node's namespace
// number before it), a BlockRemoved kv_event announced the eviction, and
// the failed load changed nothing (issue 7).
func TestLoadOfEvictedKeyFailsAndChangesNothing(t *testing.T) {
	t.Parallel()
	e := startNode(t, withPoolSlots(2))
	te := e.newEngine("e1", defaultOpts())
	te.register()
	old := []string{hash("old", 0), hash("old", 1)}
	te.send(added("a", 8), hashesEv("a", 0, old...), blocksEv("a", 0, 0, 1, 2), tokensEv("a", 8, 8))
	st := recv(t, te.stored, "old prefix stored")
	require.Equal(t, 0, st.Chunks[0].Index)
	announced := st.Chunks[0].Key // chunk 0's offload key, as stored names it
	recv(t, te.kv, "BlockStored")
	fresh := []string{hash("new", 0), hash("new", 1)}
	te.send(added("b", 8), hashesEv("b", 0, fresh...), blocksEv("b", 0, 0, 3, 4), tokensEv("b", 8, 8))
	recv(t, te.stored, "new prefix stored")
	removed := recvKV(t, te, messages.KVBlockRemoved, messages.MediumCPU)
	require.ElementsMatch(t, old, removed.BlockHashes, "one BlockRemoved for the group's evicted keys")

	before := te.sync().Pool
	te.fill(0, 9, 1)
	snapshot := append([]byte(nil), te.block(0, 9)...)
	r := te.loadInto("c", old, 8, []int{9, 10})
	require.False(t, r.OK)
	require.Contains(t, r.Error, fmt.Sprintf("%x", mustHex(old[0])))
	require.Contains(t, r.Error, "key "+announced+":", "the load error names the key stored announced")
	require.Equal(t, 0, te.lookup(old))
	require.Equal(t, before, te.sync().Pool, "a failed load pins nothing")
	require.Equal(t, snapshot, te.block(0, 9), "a failed load writes nothing")
}

// Loads racing eviction pressure never return wrong bytes: a load pins its
// keys, so a successful load copies exactly what was stored; a load that
// loses the race answers an error (issue 7).
func TestLoadsRacingEvictionNeverReturnWrongBytes(t *testing.T) {
	t.Parallel()
	e := startNode(t, withPoolSlots(6))
	te := e.newEngine("e1", func() engineOpts { o := defaultOpts(); o.blocks = 256; return o }())
	te.register()
	hot := []string{hash("hot", 0), hash("hot", 1)}
	te.fill(0, 1, 5)
	te.fill(0, 2, 5)
	want := append(append([]byte(nil), te.block(0, 1)...), te.block(0, 2)...)
	te.send(added("hot", 8), hashesEv("hot", 0, hot...), blocksEv("hot", 0, 0, 1, 2), tokensEv("hot", 8, 8))
	recv(t, te.stored, "hot prefix")

	r := te.loadInto("reader", hot, 8, []int{250, 251})
	require.True(t, r.OK, r.Error)
	require.True(t, bytes.Equal(want, append(append([]byte(nil), te.block(0, 250)...), te.block(0, 251)...)))

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // eviction pressure: 40 requests of 2 fresh chunks each
		defer wg.Done()
		for i := 0; i < 40; i++ {
			id := fmt.Sprintf("p%d", i)
			b := 10 + 2*i
			te.send(added(id, 8), hashesEv(id, 0, hash(id, 0), hash(id, 1)), blocksEv(id, 0, 0, b, b+1),
				tokensEv(id, 8, 8), finishedEv(id, false, 8, 8))
		}
	}()
	ok := 0
	for i := 0; i < 40; i++ {
		dst := []int{200 + 2*(i%20), 201 + 2*(i%20)}
		r := te.loadInto("reader", hot, 8, dst)
		if !r.OK {
			require.Contains(t, r.Error, "not ready")
			continue
		}
		ok++
		got := append(append([]byte(nil), te.block(0, messages.BlockID(dst[0]))...), te.block(0, messages.BlockID(dst[1]))...)
		require.True(t, bytes.Equal(want, got), "load %d returned wrong bytes", i)
	}
	wg.Wait()
	t.Logf("%d of 40 racing loads won the race", ok)
}

func withPoolSlots(n int64) func(*node.Config) {
	return func(c *node.Config) { c.PoolBytes = n * 256 }
}

func mustHex(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

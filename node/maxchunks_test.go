package node_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
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
	storeTinyChunks(t, te, requests, perRequest, maxChunks)
	st := te.sync()
	require.Equal(t, maxChunks, st.Pool.MaxChunks)
	require.LessOrEqual(t, st.Pool.Used, maxChunks, "the pool holds at most --pool-max-chunks")
	require.Less(t, st.Pool.Data, int64(requests*perRequest), "its bytes held every chunk: the cap evicted")
	require.GreaterOrEqual(t, metricValue(t, e.reg, "kvactors_pool_evictions_total", nil),
		float64(requests*perRequest-maxChunks))
	require.Equal(t, float64(maxChunks), metricValue(t, e.reg, "kvactors_pool_max_chunks", nil))
}

// The disk tier below the pool takes every chunk the pool evicts, and its
// index costs ~190 bytes of heap per chunk whatever the chunk's size, so
// --disk-max-chunks bounds it as --pool-max-chunks does the pool: past it
// the least recently used go, as past --disk-bytes.
func TestTinyChunksAreBoundedByDiskMaxChunks(t *testing.T) {
	t.Parallel()
	const poolChunks, diskChunks, requests, perRequest = 16, 8, 4, 40
	e := startNode(t, withDisk(t.TempDir()), func(c *node.Config) {
		c.PoolMaxChunks, c.DiskMaxChunks = poolChunks, diskChunks
	})
	o := defaultOpts()
	o.blockBytes, o.blocks = 1, 1+requests*perRequest
	te := e.newEngine("tiny", o)
	te.register()
	storeTinyChunks(t, te, requests, perRequest, poolChunks)
	// Every chunk the pool evicted reaches the disk (written, or dropped
	// past the cap); the disk evicted past its cap, never holding more.
	evicted := metricValue(t, e.reg, "kvactors_pool_evictions_total", nil)
	require.GreaterOrEqual(t, evicted, float64(requests*perRequest-poolChunks))
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if w := metricValue(t, e.reg, "kvactors_disk_evictions_total", nil); w < float64(diskChunks) {
			return fmt.Errorf("%v chunks evicted from disk", w)
		}
		if q := metricValue(t, e.reg, "kvactors_disk_queued_bytes", nil); q != 0 {
			return fmt.Errorf("%v bytes still queued for the disk", q)
		}
		return nil
	})
	require.LessOrEqual(t, metricValue(t, e.reg, "kvactors_disk_chunks", nil), float64(diskChunks),
		"the disk tier holds at most --disk-max-chunks")
}

// storeTinyChunks has te store requests requests of perRequest one-byte
// chunks each (blocks from 1) and waits for every chunk's stored, checking
// no decision offers more than maxChunks.
func storeTinyChunks(t *testing.T, te *testEngine, requests, perRequest, maxChunks int) {
	t.Helper()
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
}

// A decision offers at least one chunk of each group (capToRoom cuts at a
// token position all groups share), so an engine with more groups than
// --pool-max-chunks could never store: every offer refused, retried as
// pool_full until given up. Its register is refused instead, naming the
// setting; with the cap at its group count it stores.
func TestAnEngineWithMoreGroupsThanPoolMaxChunksIsRefused(t *testing.T) {
	t.Parallel()
	o := defaultOpts()
	o.tpb, o.kinds = []int{4, 4}, []string{"full", "full"}
	e := startNode(t, func(c *node.Config) { c.PoolMaxChunks = 1 })
	te := e.newEngine("two", o)
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(te.request("register", te.spec), &reply))
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, "--pool-max-chunks 1")

	e = startNode(t, func(c *node.Config) { c.PoolMaxChunks = 2 })
	te = e.newEngine("two", o)
	te.register()
	te.fill(0, 1, 7)
	te.fill(1, 2, 7)
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), blocksEv("r", 1, 0, 2),
		tokensEv("r", 4, 4))
	require.Len(t, recv(t, te.stored, "stored r").Chunks, 2)
}

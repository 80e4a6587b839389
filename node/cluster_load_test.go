package node_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A load whose prefix is partly in the local pool and partly held by
// another node makes room for the remote chunks without evicting its own
// local ones: they are pinned before the room is made. Before, in a full pool the room was made
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

// smallPoolPair is a 2-node cluster whose second node's pool holds three
// 256-byte chunks, engine ea on the first node and ec and ed on the
// second, all of namespace m, registered.
func smallPoolPair(t *testing.T) (kc *kvCluster, a, c, d *testEngine) {
	t.Helper()
	kc = startCluster(t, 2, func(i int, c *node.Config) {
		if i == 1 {
			c.PoolBytes = 768
		}
	})
	a, c, d = kc.engineOn(0, "ea", "m"), kc.engineOn(1, "ec", "m"), kc.engineOn(1, "ed", "m")
	a.register()
	c.register()
	d.register()
	return kc, a, c, d
}

// loadWhileStoresEvict sends c's load of hs (8 tokens into blocks 2 and 3),
// holds it at the "fetched" gate (its fetch done, before it pins) while d
// stores two chunks, the second evicting the pool's least recently used
// unpinned chunk, and returns the load's reply.
func loadWhileStoresEvict(t *testing.T, kc *kvCluster, c, d *testEngine, hs []string) messages.LoadReply {
	t.Helper()
	fetched, release := kc.nodes[1].node.HoldInClusterGate("fetched")
	defer release()
	replies := collect(t, c.e.nc, "kvactors.ec.load",
		map[string]any{"request": "rc", "hashes": hs, "num_tokens": 8, "blocks": [][]int{{2, 3}}})
	testkit.Closed(t, fetched, 10*time.Second, "C's load, its fetch done, before it pins")
	d.storeOne("x1", 50) // the pool's third chunk
	d.storeOne("x2", 51) // evicts the least recently used chunk that is not pinned
	release()
	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "C's load reply").Data, &r))
	return r
}

// A remote load's fetched chunks are pinned from when each is made ready
// until the load's own pins hold them: another engine's stores on the node
// in between evict other chunks, not these. Before, a fetched chunk was
// ready and unpinned until the load pinned its keys, and a store evicting
// it there failed the load as a miss (no disk tier) though lookup counted
// it and it had been fetched. Once the load ends nothing stays pinned.
func TestClusterFetchedChunksStayPinnedUntilTheirLoadPinsThem(t *testing.T) {
	t.Parallel()
	kc, a, c, d := smallPoolPair(t)
	hs := []string{hash("pin", 0), hash("pin", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A")
	awaitLookup(t, c, hs, 8, "C")

	r := loadWhileStoresEvict(t, kc, c, d, hs)
	require.True(t, r.OK, "a store between the fetch and the load's pins evicted a fetched chunk: %s", r.Error)
	require.Equal(t, 2, r.RemoteChunks)
	require.Equal(t, a.block(0, 40), c.block(0, 2), "chunk 0 from A")
	require.Equal(t, a.block(0, 41), c.block(0, 3), "chunk 1 from A")
	require.Zero(t, c.sync().Pool.Pinned, "a chunk stayed pinned after the load") // its copy unpinned before the reply
}

// A remote load's own chunks already in this node's host memory are
// pinned from when its fetch starts, and that pin handed to the load as
// the fetched chunks' is: another engine's stores on the node during the
// fetch evict other chunks, not these. Before, they were pinned only once
// the fetch was done, and a store evicting one there (here, at the
// "fetched" gate: C's own chunk 0, the least recently used) failed the
// load as a miss after it had fetched everything. Once the load ends
// nothing stays pinned.
func TestClusterALoadsLocalChunksStayPinnedWhileItFetches(t *testing.T) {
	t.Parallel()
	kc, a, c, d := smallPoolPair(t)
	hs := []string{hash("unpin", 0), hash("unpin", 1)}
	// A stores chunk 1 only (chunk 0's block is the null block); C holds
	// chunk 0 itself.
	a.fill(0, 41, 7)
	a.send(added("r", 8), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 0, 41), tokensEv("r", 8, 8))
	recv(t, a.stored, "stored by A")
	c.fill(0, 10, 7)
	c.send(added("c0", 4), hashesEv("c0", 0, hs[0]), blocksEv("c0", 0, 0, 10), tokensEv("c0", 4, 4))
	recv(t, c.stored, "chunk 0 stored by C")
	awaitLookup(t, c, hs, 8, "C")

	r := loadWhileStoresEvict(t, kc, c, d, hs) // the second store evicts x1, the least recently used unpinned chunk
	require.True(t, r.OK, "a store during the fetch evicted the load's own chunk 0: %s", r.Error)
	require.Equal(t, 1, r.RemoteChunks)
	require.Equal(t, c.block(0, 10), c.block(0, 2), "chunk 0 from C's pool")
	require.Equal(t, a.block(0, 41), c.block(0, 3), "chunk 1 from A")
	require.Zero(t, c.sync().Pool.Pinned, "a chunk stayed pinned after the load") // its copy unpinned before the reply
}

// A remote load refused after its fetch (here its chunk 2 is held by no
// node: a miss) lets go of the pins its fetch left on the chunks it
// fetched and on its own local ones: they stay in the pool, evictable, as
// any stored chunk.
func TestClusterALoadFailingAfterItsFetchUnpinsItsChunks(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(1, "ec", "m")
	a.register()
	c.register()
	hs := []string{hash("miss", 0), hash("miss", 1), hash("miss", 2)}
	// A stores chunk 1 only (chunk 0's block is the null block); C holds
	// chunk 0 itself; no one holds chunk 2.
	a.fill(0, 41, 7)
	a.send(added("r", 8), hashesEv("r", 0, hs[:2]...), blocksEv("r", 0, 0, 0, 41), tokensEv("r", 8, 8))
	recv(t, a.stored, "stored by A")
	c.fill(0, 10, 7)
	c.send(added("c0", 4), hashesEv("c0", 0, hs[0]), blocksEv("c0", 0, 0, 10), tokensEv("c0", 4, 4))
	recv(t, c.stored, "chunk 0 stored by C")
	awaitLookup(t, c, hs, 8, "C")

	r := c.loadInto("rc", hs, 12, []int{2, 3, 4})
	require.False(t, r.OK, "chunk 2 is held nowhere")
	require.Contains(t, r.Error, hs[2])
	st := c.sync().Pool
	require.Equal(t, 2, st.Ready, "chunk 0 and the fetched chunk 1 stay")
	require.Zero(t, st.Pinned, "the failed load left its fetched or local chunks pinned")
}

// A remote load whose fetch fails at one chunk after another was made
// ready lets go of that one's pin and of its own local chunk's: they stay
// in the pool, evictable. Chunk 0 is held by A only, chunk 1 by B only,
// chunk 2 by C, the loading node, itself; A's fetch server is held (it
// serves one fetch at a time) while B's serves chunk 1, and A evicts
// chunk 0.
func TestClusterAFailedFetchUnpinsTheChunksItFetched(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3, func(i int, c *node.Config) {
		if i == 0 {
			c.PoolBytes = 512 // two 256-byte chunks: two more stores evict chunk 0
		}
	})
	a := kc.engineOn(0, "ea", "m")
	b := kc.engineOn(1, "eb", "m")
	c := kc.engineOn(2, "ec", "m")
	a.register()
	b.register()
	c.register()
	hs := []string{hash("half", 0), hash("half", 1), hash("half", 2)}
	a.fill(0, 40, 5)
	a.send(added("r", 4), hashesEv("r", 0, hs[0]), blocksEv("r", 0, 0, 40), tokensEv("r", 4, 4))
	recv(t, a.stored, "chunk 0 stored by A")
	b.fill(0, 41, 5) // chunk 0's block is the null block: B stores chunk 1 only
	b.send(added("r", 8), hashesEv("r", 0, hs[:2]...), blocksEv("r", 0, 0, 0, 41), tokensEv("r", 8, 8))
	recv(t, b.stored, "chunk 1 stored by B")
	c.fill(0, 42, 5) // C stores chunk 2 only
	c.send(added("c2", 12), hashesEv("c2", 0, hs...), blocksEv("c2", 0, 0, 0, 0, 42), tokensEv("c2", 12, 12))
	recv(t, c.stored, "chunk 2 stored by C")
	awaitLookup(t, c, hs, 12, "C")

	serving, release := kc.nodes[0].node.HoldInClusterGate("read")
	defer release()
	replies := collect(t, c.e.nc, "kvactors.ec.load",
		map[string]any{"request": "rc", "hashes": hs, "num_tokens": 12, "blocks": [][]int{{2, 3, 4}}})
	testkit.Closed(t, serving, 10*time.Second, "A serving C's fetch of chunk 0, held")
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if got := c.sync().Pool.Ready; got != 2 {
			return fmt.Errorf("C's pool holds %d chunks ready, want its chunk 2 and chunk 1, fetched from B", got)
		}
		return nil
	})
	a.storeOne("x1", 50) // A's pool holds two chunks: these two evict chunk 0
	a.storeOne("x2", 51)
	release()

	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "C's load reply").Data, &r))
	require.False(t, r.OK, "chunk 0 was evicted before A read it")
	require.Contains(t, r.Error, hs[0])
	require.Zero(t, c.sync().Pool.Pinned, "the failed fetch left chunk 1 or C's own chunk 2 pinned")
}

// A remote load's own local chunk that is still pending (its store's copy
// running) as the fetch starts is pinned for the load as that copy makes
// it ready, not left evictable until the load pins its keys: another
// engine's stores on the node meanwhile (here at the "fetched" gate) evict
// other chunks. Before, only the chunks ready as the fetch started were
// pinned, and a store evicting the one made ready during the fetch (C's
// chunk 0, then the least recently used) failed the load as a miss after
// it had fetched everything. Once the load ends nothing stays pinned.
func TestClusterALoadsLocalChunkPendingAsItsFetchStartsIsPinnedOnceReady(t *testing.T) {
	t.Parallel()
	dev := &deviceGate{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	kc := startCluster(t, 2, func(i int, c *node.Config) {
		if i == 1 {
			c.PoolBytes = 768 // three 256-byte chunks
			c.WrapDevice = dev.wrap
		}
	})
	t.Cleanup(func() { dev.hold.Store(false); close(dev.gate) }) // before the nodes' Close: no copy left held
	a, c, d := kc.engineOn(0, "ea", "m"), kc.engineOn(1, "ec", "m"), kc.engineOn(1, "ed", "m")
	a.register()
	c.register()
	d.register()
	hs := []string{hash("pending", 0), hash("pending", 1)}
	// A stores chunk 1 only (chunk 0's block is the null block).
	a.fill(0, 41, 7)
	a.send(added("r", 8), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 0, 41), tokensEv("r", 8, 8))
	recv(t, a.stored, "stored by A")
	awaitLookup(t, c, hs[1:], 4, "C") // C's node knows A holds chunk 1
	// C stores chunk 0 itself, its copy held: pending in C's pool.
	dev.hold.Store(true)
	c.fill(0, 10, 7)
	c.send(added("c0", 4), hashesEv("c0", 0, hs[0]), blocksEv("c0", 0, 0, 10), tokensEv("c0", 4, 4))
	testkit.Recv(t, dev.started, 10*time.Second, "C's copy of chunk 0, held")
	dev.hold.Store(false)

	// C's load starts its fetch of chunk 1 with chunk 0 pending; chunk 0's
	// copy ends during the fetch.
	fetching, releaseFetch := kc.nodes[1].node.HoldInClusterGate("fetch")
	defer releaseFetch()
	replies := collect(t, c.e.nc, "kvactors.ec.load",
		map[string]any{"request": "rc", "hashes": hs, "num_tokens": 8, "blocks": [][]int{{2, 3}}})
	testkit.Closed(t, fetching, 10*time.Second, "C's load fetching chunk 1")
	dev.gate <- struct{}{}
	recv(t, c.stored, "chunk 0 stored by C, during the fetch")
	fetched, releaseFetched := kc.nodes[1].node.HoldInClusterGate("fetched") // the held fetch stays in the "fetch" gate
	defer releaseFetched()
	releaseFetch()
	testkit.Closed(t, fetched, 10*time.Second, "C's load, its fetch done, before it pins")
	d.storeOne("x1", 50) // the pool's third chunk
	d.storeOne("x2", 51) // evicts the least recently used chunk that is not pinned
	releaseFetched()
	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "C's load reply").Data, &r))
	require.True(t, r.OK, "a store during the fetch evicted the load's own chunk 0, made ready as it fetched: %s", r.Error)
	require.Equal(t, 1, r.RemoteChunks)
	require.Equal(t, c.block(0, 10), c.block(0, 2), "chunk 0 from C's pool")
	require.Equal(t, a.block(0, 41), c.block(0, 3), "chunk 1 from A")
	require.Zero(t, c.sync().Pool.Pinned, "a chunk stayed pinned after the load")
}

package node_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

func withDisk(dir string) func(*node.Config) {
	return func(c *node.Config) { c.DiskDir, c.DiskBytes = dir, 1<<20 }
}

// recvKVHashes gathers the hashes of te's next typ events on medium
// (recvKV) until it has n: a batch of changes may come as one event or
// several. Each event must name namespace ns ("": any).
func recvKVHashes(t *testing.T, te *testEngine, typ, medium, ns string, n int) []string {
	t.Helper()
	var hs []string
	for len(hs) < n {
		ev := recvKV(t, te, typ, medium)
		if ns != "" {
			require.Equal(t, ns, ev.Namespace)
		}
		hs = append(hs, ev.BlockHashes...)
	}
	return hs
}

// recvKV waits for the next kv_events event of typ on medium, looking at
// every event of each batch and keeping the others, in order, for later
// calls: a host eviction and the disk write of the evicted chunk are
// announced from different goroutines, in either order, maybe in one batch.
func recvKV(t *testing.T, te *testEngine, typ, medium string) messages.KVEvent {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		for i, ev := range te.kvLeft {
			if ev.Type == typ && ev.Medium == medium {
				te.kvLeft = append(te.kvLeft[:i:i], te.kvLeft[i+1:]...)
				return ev
			}
		}
		select {
		case b := <-te.kv:
			te.kvLeft = append(te.kvLeft, b.Events...)
		case <-deadline:
			t.Fatalf("no %s on %s", typ, medium)
		}
	}
}

// Issue 12, disk tier: chunks evicted from host memory are written to disk
// (BlockStored, medium DISK) instead of vanishing; lookup counts them; a
// load brings them back disk → host → device byte-identical; after a
// restart the node re-indexes the directory and serves them again; a chunk
// corrupted on disk is never loaded (error naming it, BlockRemoved DISK).
func TestDiskTierSpillLoadRestartCorrupt(t *testing.T) {
	t.Parallel()
	diskDir := t.TempDir()
	e := startNode(t, withPoolSlots(2), withDisk(diskDir))
	te := e.newEngine("e1", defaultOpts())
	te.register()
	old := []string{hash("old", 0), hash("old", 1)}
	te.fill(0, 1, 7)
	te.fill(0, 2, 7)
	want := append(bytes.Clone(te.block(0, 1)), te.block(0, 2)...)
	te.send(added("a", 8), hashesEv("a", 0, old...), blocksEv("a", 0, 0, 1, 2), tokensEv("a", 8, 8))
	recv(t, te.stored, "old prefix stored")
	te.send(added("b", 8), hashesEv("b", 0, hash("new", 0), hash("new", 1)), blocksEv("b", 0, 0, 3, 4),
		tokensEv("b", 8, 8))
	recv(t, te.stored, "new prefix stored (evicting old)")
	evicted := recvKVHashes(t, te, messages.KVBlockRemoved, messages.MediumCPU, "", len(old))
	require.ElementsMatch(t, old, evicted, "the old prefix left host memory")
	onDisk := recvKVHashes(t, te, messages.KVBlockStored, messages.MediumDisk, "", len(old)) // each as it lands
	require.ElementsMatch(t, old, onDisk, "the evicted chunks reached the disk")
	require.Equal(t, 8, te.lookup(old), "lookup counts disk chunks")

	load := func(te *testEngine, dst []int) {
		t.Helper()
		te.fill(0, messages.BlockID(dst[0]), 0)
		te.fill(0, messages.BlockID(dst[1]), 0)
		r := te.loadInto("c", old, 8, dst)
		require.True(t, r.OK, r.Error)
		got := append(bytes.Clone(te.block(0, messages.BlockID(dst[0]))), te.block(0, messages.BlockID(dst[1]))...)
		require.Equal(t, want, got, "disk → host → device, byte-identical")
	}
	load(te, []int{10, 11})
	require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_disk_hits_total", nil)/2, "two chunks read back")
	madeRoom := recvKV(t, te, messages.KVBlockRemoved, messages.MediumCPU) // the new prefix made room
	require.NotEmpty(t, madeRoom.BlockHashes)
	require.Subset(t, []string{hash("new", 0), hash("new", 1)}, madeRoom.BlockHashes)
	// Read back into host memory, loadable there again: each old hash has a
	// second BlockStored CPU (the first was its original store).
	seen := map[string]int{}
	for seen[old[0]] < 2 || seen[old[1]] < 2 {
		for _, h := range recvKV(t, te, messages.KVBlockStored, messages.MediumCPU).BlockHashes {
			seen[h]++
		}
	}
	require.NoError(t, e.node.Close(context.Background()))

	// Restart on the same directory: the index is rebuilt from the files.
	e2 := startNode(t, withPoolSlots(2), withDisk(diskDir))
	te2 := e2.newEngine("e1", defaultOpts())
	te2.register()
	require.Equal(t, 8, te2.lookup(old), "the old prefix is found on disk after a restart")
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := metricValue(t, e2.reg, "kvactors_disk_chunks", nil); n < 2 {
			return fmt.Errorf("%v chunks indexed", n)
		}
		return nil
	})
	// new prefix chunks were spilled when old came back: both prefixes on disk
	newKeys := []string{hash("new", 0), hash("new", 1)}
	require.Equal(t, 8, te2.lookup(newKeys))

	// Corrupt one of the new prefix's records on disk: its load fails naming it.
	var target messages.Key // disk keys end with the offload key: hash, then group 0
	for _, k := range e2.node.Disk().Keys() {
		if strings.HasSuffix(string(k), string(mustHex(newKeys[1]))+"\x00\x00\x00\x00") {
			target = k
		}
	}
	path, off, ok := e2.node.Disk().Where(target)
	require.True(t, ok, "the record of %s", newKeys[1])
	flipByte(t, path, off+5)
	te2.fill(0, 20, 3)
	te2.fill(0, 21, 3)
	before := append(bytes.Clone(te2.block(0, 20)), te2.block(0, 21)...)
	r := te2.loadInto("d", newKeys, 8, []int{20, 21})
	require.False(t, r.OK)
	require.Contains(t, r.Error, newKeys[1], "the error names the corrupt key")
	require.Equal(t, before, append(bytes.Clone(te2.block(0, 20)), te2.block(0, 21)...), "nothing reached the device")
	removed := recvKV(t, te2, messages.KVBlockRemoved, messages.MediumDisk)
	require.Equal(t, []string{newKeys[1]}, removed.BlockHashes)
	require.Equal(t, 4, te2.lookup(newKeys), "the corrupt chunk is gone from every tier")
	require.Zero(t, te2.sync().Pool.Pinned)
	require.Zero(t, te2.sync().Pool.Pending, "no room left held for the failed read")
}

// PROTOCOL.md "Isolation" across a restart: namespace ids are given in
// registration order, so they differ from boot to boot; the disk tier keys
// chunks by namespace name and geometry instead. A chunk engine ta spilled
// is not a hit for engine tb after a restart in which tb registered first
// (and got the id ta had), nor for engine mal, which names "ta" as its
// (shared) namespace, and it still is for ta.
func TestDiskChunksStayInTheirNamespaceAcrossRestarts(t *testing.T) {
	t.Parallel()
	diskDir := t.TempDir()
	prefix := []string{hash("shared", 0), hash("shared", 1)}
	e := startNode(t, withPoolSlots(2), withDisk(diskDir))
	ta, tb := e.newEngine("ta", defaultOpts()), e.newEngine("tb", defaultOpts())
	ta.register()
	tb.register()
	ta.fill(0, 1, 4)
	ta.fill(0, 2, 4)
	want := append(bytes.Clone(ta.block(0, 1)), ta.block(0, 2)...)
	ta.send(added("x", 8), hashesEv("x", 0, prefix...), blocksEv("x", 0, 0, 1, 2), tokensEv("x", 8, 8))
	recv(t, ta.stored, "ta's prefix stored")
	ta.send(added("y", 8), hashesEv("y", 0, hash("other", 0), hash("other", 1)), blocksEv("y", 0, 0, 3, 4),
		tokensEv("y", 8, 8))
	recv(t, ta.stored, "ta's second prefix stored, the first evicted")
	require.ElementsMatch(t, prefix, recvKVHashes(t, ta, messages.KVBlockStored, messages.MediumDisk, "", 2),
		"ta's first prefix reached the disk")
	require.Equal(t, 0, tb.lookup(prefix), "another namespace never sees ta's chunks")
	require.NoError(t, e.node.Close(context.Background()))

	e2 := startNode(t, withPoolSlots(2), withDisk(diskDir))
	tb2, ta2 := e2.newEngine("tb", defaultOpts()), e2.newEngine("ta", defaultOpts())
	mal := e2.newEngine("mal", defaultOpts())
	mal.spec.Namespace = "ta" // ta's id: a shared namespace of that name, never ta's own
	mal.register()
	tb2.register() // tb now gets the namespace id ta had in the first boot
	ta2.register()
	require.Equal(t, 0, tb2.lookup(prefix), "after the restart too")
	require.Equal(t, 0, mal.lookup(prefix), "ta's namesake never sees ta's chunks on disk")
	malBefore := append(bytes.Clone(mal.block(0, 10)), mal.block(0, 11)...)
	require.False(t, mal.loadInto("steal", prefix, 8, []int{10, 11}).OK, "ta's namesake cannot load them")
	require.Equal(t, malBefore, append(bytes.Clone(mal.block(0, 10)), mal.block(0, 11)...))
	before := append(bytes.Clone(tb2.block(0, 10)), tb2.block(0, 11)...)
	r := tb2.loadInto("steal", prefix, 8, []int{10, 11})
	require.False(t, r.OK, "tb cannot load ta's chunks")
	require.Contains(t, r.Error, "not ready", "a miss, not a failure partway through a copy")
	require.Equal(t, before, append(bytes.Clone(tb2.block(0, 10)), tb2.block(0, 11)...), "no byte of ta's reached tb's blocks")
	require.Equal(t, 8, ta2.lookup(prefix), "ta finds its chunks on disk")
	r = ta2.loadInto("back", prefix, 8, []int{10, 11})
	require.True(t, r.OK, r.Error)
	require.Equal(t, want, append(bytes.Clone(ta2.block(0, 10)), ta2.block(0, 11)...))
}

// Node heartbeats never wait for the disk tier's lock (statsLoop gathers
// the pool's and disk's figures off the heartbeat's path): engines judge
// the node by them, and the disk holds its lock across file operations a
// slow filesystem can stretch. The lock is held here by a disk read that
// finds a record corrupt: it drops the record and announces the drop under
// the disk's lock, and the announcement waits for the kv_events journal,
// which the test holds. A restart first empties the pool, so the load
// needs no eviction (which the journal would hold up before the disk).
func TestNodeHeartbeatsGoOnWhileTheDiskHoldsItsLock(t *testing.T) {
	t.Parallel()
	const lease = 2 * time.Second // node heartbeats every 500ms
	diskDir := t.TempDir()
	withLease := func(c *node.Config) { c.Lease = lease }
	e := startNode(t, withPoolSlots(2), withDisk(diskDir), withLease)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.storeOne("a", 1)
	te.storeOne("b", 2)
	te.storeOne("c", 3) // evicts one chunk from the pool of two: it is written to disk
	spilled := recvKVHashes(t, te, messages.KVBlockStored, messages.MediumDisk, "", 1)[0]
	require.NoError(t, e.node.Close(context.Background()))

	e2 := startNode(t, withPoolSlots(2), withDisk(diskDir), withLease)
	te2 := e2.newEngine("e1", defaultOpts())
	te2.register()
	keys := e2.node.Disk().Keys()
	require.Len(t, keys, 1)
	path, off, ok := e2.node.Disk().Where(keys[0])
	require.True(t, ok)
	flipByte(t, path, off+5)
	beats := testkit.Subscribe(t, e2.nc, "kvactors._node."+e2.node.NodeID()+".heartbeat")
	te2.heartbeat("", 0) // a sign of life: the engine outlives what follows

	release := e2.node.HoldKVJournal()
	t.Cleanup(release) // before the node's Close
	loadReply := make(chan *nats.Msg, 1)
	inbox := testkit.EngineInbox("e1")
	_, err := e2.nc.ChanSubscribe(inbox, loadReply)
	require.NoError(t, err)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{spilled}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	require.NoError(t, e2.nc.PublishRequest("kvactors.e1.load", inbox, body))
	const dropping = "disk.(*Disk).dropItem"
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !running(dropping) {
			return fmt.Errorf("the corrupt record is not being dropped yet")
		}
		return nil
	})
	for len(beats) > 0 { // from before the disk took its lock
		<-beats
	}
	for i := range 3 {
		testkit.Recv(t, beats, lease, fmt.Sprintf("node heartbeat %d while the disk holds its lock", i+1))
	}
	require.True(t, running(dropping), "the disk's lock was let go: the heartbeats proved nothing")
	testkit.NoRecv(t, loadReply, 0, "the load's reply while its read is stuck")

	release()
	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, loadReply, 5*time.Second, "the load's reply").Data, &r))
	require.False(t, r.OK)
	require.Contains(t, r.Error, spilled, "the error names the corrupt key")
}

// running reports whether a goroutine of this process is in function fn
// now (its stack names it).
func running(fn string) bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Contains(string(buf[:n]), fn+"(")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// flipByte flips one bit of the byte at off in the file at path: a corrupt
// record on disk.
func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	b := []byte{0}
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	b[0] ^= 1
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

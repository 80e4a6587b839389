package node_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// The address-space attack (docs/SECURITY.md "Address space"): shm objects
// cost their engine only the pages it writes, so an engine can register
// sparse objects of terabytes. The node maps only the span of each segment
// its regions use, counts those bytes against --max-mapped-bytes, and
// refuses a segment no region uses.

const tib = int64(1) << 40

// pageUp rounds n up to whole pages.
func pageUp(n int64) int64 {
	page := int64(os.Getpagesize())
	return (n + page - 1) &^ (page - 1)
}

// sparseSegment creates dir/name of size bytes with ftruncate (free on
// tmpfs and on ext4 alike) and returns it open, for pread/pwrite: the test
// never maps it, so every mapping of it in this process is the node's.
func sparseSegment(t *testing.T, dir, name string, size int64) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close(); _ = os.Remove(f.Name()) })
	require.NoError(t, f.Truncate(size))
	return f
}

func mappedBytes(t *testing.T, e *env) int64 {
	t.Helper()
	return int64(metricValue(t, e.reg, "kvactors_isolation_mapped_bytes", nil))
}

func registerReply(t *testing.T, te *testEngine) messages.RegisterReply {
	t.Helper()
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(te.request("register", te.spec), &reply))
	return reply
}

// A register whose segments would pass --max-mapped-bytes is refused
// "limit" and maps nothing; honest engines register after it; an
// unregistered engine gives its bytes back.
func TestMaxMappedBytesRefusesAndReturns(t *testing.T) {
	t.Parallel()
	unit := pageUp(64 * 256) // defaultOpts: 64 blocks of 256 bytes
	e := startNode(t, func(c *node.Config) { c.MaxMappedBytes = 3 * unit })
	vic, hs, want := victim(t, e)
	require.Equal(t, unit, mappedBytes(t, e))

	// The attack: a 1 TiB sparse object whose one region spans all of it.
	mal := e.newEngine("mal", defaultOpts())
	sparseSegment(t, e.dir, "mal-big", tib)
	mal.spec.Segments = []messages.Segment{{Shm: "mal-big"}}
	mal.spec.Groups[0].Regions[0] = messages.Region{BlockStride: tib / 64, BlockBytes: 256}
	before := rejected(t, e, "limit")
	reply := registerReply(t, mal)
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, "--max-mapped-bytes")
	require.Equal(t, before+1, rejected(t, e, "limit"), "counted as limit")
	require.Empty(t, testkit.Mappings(t, filepath.Join(e.dir, "mal-big")), "nothing of it mapped")
	require.Equal(t, unit, mappedBytes(t, e))

	hon := e.newEngine("hon", defaultOpts())
	hon.register()
	require.Equal(t, 2*unit, mappedBytes(t, e))

	// Two units more would pass three: refused, and only the engine's own
	// mapping of its object exists.
	o := defaultOpts()
	o.blocks = int(2 * unit / o.blockBytes)
	dbl := e.newEngine("dbl", o)
	reply = registerReply(t, dbl)
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, "--max-mapped-bytes")
	require.Len(t, testkit.Mappings(t, filepath.Join(e.dir, "dbl-seg")), 1, "the engine's own mapping only")

	// hon's bytes come back with its unregister (answered once unmapped).
	var un messages.UnregisterReply
	require.NoError(t, jsonUnmarshal(hon.request("unregister", map[string]any{}), &un))
	require.True(t, un.OK, un.Error)
	require.Equal(t, unit, mappedBytes(t, e), "hon's bytes given back")
	dbl.register()
	require.Equal(t, 3*unit, mappedBytes(t, e))
	require.Len(t, testkit.Mappings(t, filepath.Join(e.dir, "dbl-seg")), 2, "the engine's and the node's")
	intact(t, vic, hs, want)
}

// A segment of a terabyte whose region uses 16 KiB near its end: the node
// maps that span's pages only (the kernel's own list says so, and so does
// the metric), and a store and a load through it move the right bytes.
func TestSparseSegmentMapsOnlyTheRegionSpan(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("sp", defaultOpts())
	f := sparseSegment(t, e.dir, "sp-big", tib)
	off := tib - 64<<10 + 100 // not page-aligned
	te.spec.Segments = []messages.Segment{{Shm: "sp-big"}}
	te.spec.Groups[0].Regions[0] = messages.Region{Offset: off, BlockStride: 256, BlockBytes: 256}
	te.register()

	page := int64(os.Getpagesize())
	base, end := off&^(page-1), off+64*256
	require.Equal(t, []testkit.Mapping{{Off: base, Len: pageUp(end) - base}},
		testkit.Mappings(t, filepath.Join(e.dir, "sp-big")), "the region's pages, not the terabyte")
	require.Equal(t, pageUp(end)-base, mappedBytes(t, e))

	block := func(b int64) []byte {
		p := make([]byte, 256)
		_, err := f.ReadAt(p, off+b*256)
		require.NoError(t, err)
		return p
	}
	var want [][]byte
	for b := int64(40); b < 44; b++ {
		p := bytes.Repeat([]byte{byte(b)}, 256)
		copy(p, "block")
		p[255] = byte(b * 3)
		_, err := f.WriteAt(p, off+b*256)
		require.NoError(t, err)
		want = append(want, p)
	}
	hs := []string{hash("s", 0), hash("s", 1), hash("s", 2), hash("s", 3)}
	te.send(added("r", 16), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 40, 41, 42, 43), tokensEv("r", 16, 16))
	recv(t, te.stored, "store")
	r := te.loadInto("l", hs, 16, []int{50, 51, 52, 53})
	require.True(t, r.OK, r.Error)
	for i := range 4 {
		require.Equal(t, want[i], block(int64(50+i)), "block %d holds what block %d held", 50+i, 40+i)
	}

	var un messages.UnregisterReply
	require.NoError(t, jsonUnmarshal(te.request("unregister", map[string]any{}), &un))
	require.True(t, un.OK, un.Error)
	require.Empty(t, testkit.Mappings(t, filepath.Join(e.dir, "sp-big")), "unmapped at unregister")
	require.Zero(t, mappedBytes(t, e))
}

// A segment that no region uses would be mapped for nothing: refused
// bad_spec, nothing mapped.
func TestSegmentNoRegionUsesIsRefused(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("two", defaultOpts())
	spare, err := shm.Create(e.dir, "two-spare", 4096)
	require.NoError(t, err)
	t.Cleanup(func() { _ = spare.Remove() })
	require.NoError(t, spare.Close()) // no mapping of it left in this process
	honest := te.spec
	te.spec.Segments = append([]messages.Segment{{Shm: "two-spare"}}, te.spec.Segments...)
	te.spec.Groups = append([]messages.GroupSpec(nil), te.spec.Groups...)
	te.spec.Groups[0].Regions = []messages.Region{{Segment: 1, BlockStride: 256, BlockBytes: 256}}
	before := rejected(t, e, "bad_spec")
	reply := registerReply(t, te)
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, "segment 0: no region uses it")
	require.Equal(t, before+1, rejected(t, e, "bad_spec"))
	require.Empty(t, testkit.Mappings(t, filepath.Join(e.dir, "two-spare")))
	require.Zero(t, metricValue(t, e.reg, "kvactors_isolation_segments_mapped", nil))
	require.Zero(t, mappedBytes(t, e))
	te.spec = honest
	te.register()
}

// --max-model-len (PROTOCOL.md "Isolation", bounds): a spec asking for a
// longer max_model_len is refused "limit"; one that gives none is bounded
// by the node's, so its requests hold no more than that.
func TestMaxModelLenBound(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.MaxModelLen = 64 })
	long := e.newEngine("long", defaultOpts())
	long.spec.MaxModelLen = 65
	before := rejected(t, e, "limit")
	reply := registerReply(t, long)
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, "--max-model-len")
	require.Equal(t, before+1, rejected(t, e, "limit"))
	long.spec.MaxModelLen = 64
	long.register()

	// No max_model_len: 64 blocks × 4 tokens would allow 256 tokens; the
	// node's 64 allow 16 hashes (tph 4).
	dflt := e.newEngine("dflt", defaultOpts())
	dflt.register()
	hs := make([]string, 17)
	for i := range hs {
		hs[i] = hash("m", i)
	}
	big := rejected(t, e, "too_large")
	dflt.send(added("r", 68), hashesEv("r", 0, hs...))
	dflt.sync()
	require.Equal(t, big+1, rejected(t, e, "too_large"), "17 hashes: past the node's bound")
	dflt.send(hashesEv("r", 0, hs[:16]...))
	dflt.sync()
	require.Equal(t, big+1, rejected(t, e, "too_large"), "16 hashes fit")
}

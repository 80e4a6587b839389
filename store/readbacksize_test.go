package store

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// A load checks that each chunk it copies out is its group's chunk size.
// A chunk read back from disk is given room of its record's size (disk.Has),
// so a record under the key of another size (a geometry the disk key's
// 64-bit FNV fingerprint failed to tell apart, or a record left by another
// build) would otherwise reach the device as the chunk, the load answering
// ok. It fails naming the key, nothing reaches the device, and the record
// is dropped. Larger or smaller.
func TestAReadBackOfAnotherSizeIsRefused(t *testing.T) {
	for _, size := range []int{2 * testBlockBytes, testBlockBytes / 2} { // twice and half the layout's chunk
		t.Run(fmt.Sprint(size), func(t *testing.T) { testAReadBackOfAnotherSizeIsRefused(t, size) })
	}
}

func testAReadBackOfAnotherSizeIsRefused(t *testing.T, size int) {
	s, e, dev, d := diskFixture(t)
	rec := bytes.Repeat([]byte{0xAB}, size)
	require.True(t, d.Spill("e", "a", crc32.Checksum(rec, castagnoli), rec))
	waitOnDisk(t, d, "a")
	require.True(t, s.Ready("a"), "on disk")
	require.False(t, e.Ready("a"), "a hit for an engine whose load refuses it")
	_, err := e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	before := bytes.Clone(dev.mem)
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil)
	require.ErrorIs(t, err, ErrCorrupt, "a record of another size was loaded as the chunk")
	var ke *hostpool.KeyError
	require.ErrorAs(t, err, &ke)
	assert.Equal(t, messages.Key("a"), ke.Key)
	assert.Equal(t, before, dev.mem, "nothing reached the device")
	st := s.Stats()
	assert.Zero(t, st.Pinned)
	assert.Zero(t, st.Pending, "the room given to the read back is freed")
	// Dropped as a corrupt chunk is: no longer a hit, and the next load of
	// it is a plain miss rather than the same failure again.
	_, _, onDisk := d.Has("a")
	assert.False(t, onDisk, "the misfit record is dropped from disk")
	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.ErrorIs(t, err, hostpool.ErrNotReady)
}

// The same for a chunk in host memory of another size than the loading
// engine's group (an engine of another geometry stored it under the key):
// the load fails naming it, nothing reaches the device, and the pool entry
// is dropped, so the next load of it is a plain miss.
func TestAChunkInHostMemoryOfAnotherSizeIsRefused(t *testing.T) {
	s, e, dev, _ := fixture(t, 1, 8*testBlockBytes, testBlockBytes)
	wide := s.Engine("f", mustLayout(t, 2, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes}), dev)
	storeChunks(t, wide, chunk("a", 1, 2)) // twice e's chunk
	require.True(t, wide.Ready("a"))
	require.False(t, e.Ready("a"), "a hit for an engine whose load refuses it")
	_, err := e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	before := bytes.Clone(dev.mem)
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil)
	require.ErrorIs(t, err, ErrCorrupt, "a chunk of another size was loaded")
	var ke *hostpool.KeyError
	require.ErrorAs(t, err, &ke)
	assert.Equal(t, messages.Key("a"), ke.Key)
	assert.Equal(t, before, dev.mem, "nothing reached the device")
	assert.Zero(t, s.Stats().Pinned)
	assert.False(t, s.Ready("a"), "the misfit is dropped from host memory")
	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.ErrorIs(t, err, hostpool.ErrNotReady)
}

// A record on disk larger than the whole pool (the pool made smaller since
// it was written) can never be read back: it is no lookup hit, and a load
// of it drops it and is a plain miss, not "no room" for ever.
func TestARecordLargerThanThePoolIsNoHitAndIsDropped(t *testing.T) {
	s, e, _, d := diskFixture(t)
	rec := bytes.Repeat([]byte{0xCD}, 8*testBlockBytes) // twice the pool
	require.True(t, d.Spill("e", "big", crc32.Checksum(rec, castagnoli), rec))
	waitOnDisk(t, d, "big")
	require.False(t, s.Ready("big"), "counted as a hit")
	_, err := e.PrepareLoad([]messages.Key{"big"})
	require.ErrorIs(t, err, hostpool.ErrNotReady, "a miss, not no room")
	_, _, onDisk := d.Has("big")
	require.False(t, onDisk, "the record the pool can never take is dropped")
	if d.Spill("e", "empty", crc32.Checksum(nil, castagnoli), []byte{}) {
		waitOnDisk(t, d, "empty")
		require.False(t, s.Ready("empty"), "an empty record counted as a hit")
	}
}

// diskFixture is a store of a 4-block pool over a disk tier, and engine e
// of one 1-block group on an 8-block device.
func diskFixture(t *testing.T) (*Store, *Engine, *memDevice, *disk.Disk) {
	t.Helper()
	l := mustLayout(t, 1, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &memDevice{mem: make([]byte, 8*testBlockBytes)}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	s := New(heapArena(make([]byte, 4*testBlockBytes)), testBlockBytes, d, metrics.NewPool(nil))
	return s, s.Engine("e", l, dev), dev, d
}

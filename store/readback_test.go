package store

import (
	"bytes"
	"fmt"
	"hash/crc32"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// A chunk on disk that one load was given room to read back into is Ready
// (a lookup hit) while that load is queued or reading; a second load of it
// is told hostpool.ErrPending naming it (still a not-ready error), not a
// plain miss, and WaitPending wakes it once the first load's read made
// the chunk ready: it then loads the same bytes.
func TestASecondLoadOfAChunkBeingReadBackIsToldToWait(t *testing.T) {
	s, e, _, dev := onDiskOnly(t)

	_, err := e.PrepareLoad([]messages.Key{"a"}) // load 1: room to read a back into
	require.NoError(t, err)
	require.True(t, s.Ready("a"), "a lookup while a is read back")
	_, err = e.PrepareLoad([]messages.Key{"a"}) // load 2
	require.ErrorIs(t, err, hostpool.ErrPending)
	require.ErrorIs(t, err, hostpool.ErrNotReady)
	var ke *hostpool.KeyError
	require.ErrorAs(t, err, &ke)
	require.Equal(t, messages.Key("a"), ke.Key)
	woken := hostpool.NewSignal()
	e.WaitPending([]messages.Key{ke.Key}, woken)
	testkit.NoRecv(t, woken, 0, "a wake-up before a is read back")

	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil)) // load 1's read and copy
	testkit.Recv(t, woken, 5*time.Second, "the wake-up once a is read back")
	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err, "load 2, tried again")
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 6)}, nil))
	bb := int(testBlockBytes)
	require.Equal(t, dev.mem[1*bb:2*bb], dev.mem[5*bb:6*bb], "load 1")
	require.Equal(t, dev.mem[1*bb:2*bb], dev.mem[6*bb:7*bb], "load 2")
	st := s.Stats()
	require.Zero(t, st.Pinned)
	require.Zero(t, st.Pending)
}

// onDiskOnly is a store of two chunks over a disk tier whose engine stored
// a, b and c from device blocks 1, 2 and 3 (patterned bytes): a, evicted,
// is on disk only.
func onDiskOnly(t *testing.T) (*Store, *Engine, *disk.Disk, *memDevice) {
	t.Helper()
	l := mustLayout(t, 1, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &memDevice{mem: make([]byte, 8*testBlockBytes)}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	s := New(heapArena(make([]byte, 2*testBlockBytes)), testBlockBytes, d, metrics.NewPool(nil))
	e := s.Engine("e", l, dev)
	storeChunks(t, e, chunk("a", 1))
	storeChunks(t, e, chunk("b", 2))
	storeChunks(t, e, chunk("c", 3)) // evicts a, written to disk
	waitOnDisk(t, d, "a")
	return s, e, d, dev
}

// waitOnDisk waits until the disk tier holds key (its writer wrote it).
func waitOnDisk(t *testing.T, d *disk.Disk, key messages.Key) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		if _, _, ok := d.Has(key); !ok {
			return fmt.Errorf("%s not on disk yet", key)
		}
		return nil
	})
}

// hookDevice is memDevice running before, once, at its next copy.
type hookDevice struct {
	memDevice
	before func()
}

func (d *hookDevice) Copy(dir backend.Direction, a backend.Arena, rs []backend.Range) error {
	if f := d.before; f != nil {
		d.before = nil
		f()
	}
	return d.memDevice.Copy(dir, a, rs)
}

// A chunk a load read back from disk is made ready pinned, in the step
// that makes it ready: a store deciding while the load copies it to the
// device, into a pool the chunk fills, finds no room rather than evicting
// it and writing over the bytes on their way out (the load does not check
// a read-back chunk's bytes again: fetch checked them).
func TestAChunkReadBackStaysPinnedUntilItsLoadCopiedIt(t *testing.T) {
	l := mustLayout(t, 1, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &hookDevice{memDevice: memDevice{mem: make([]byte, 8*testBlockBytes)}}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	s := New(heapArena(make([]byte, testBlockBytes)), testBlockBytes, d, metrics.NewPool(nil)) // one chunk
	e := s.Engine("e", l, dev)
	rec := bytes.Repeat([]byte{0xAB}, testBlockBytes)
	require.True(t, d.Spill("e", "a", crc32.Checksum(rec, castagnoli), rec))
	waitOnDisk(t, d, "a")
	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)

	var during error
	dev.before = func() {
		var prep hostpool.Prepared
		if prep, during = e.PrepareStore([]messages.Key{"x"}, []int64{testBlockBytes}); during == nil {
			for _, x := range prep.Ext {
				clear(s.arena.Bytes()[x.Off : x.Off+x.Len]) // x's copy, over a's bytes
			}
		}
	}
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil))
	require.ErrorIs(t, during, hostpool.ErrNoRoom, "a store evicted the chunk being loaded")
	require.Equal(t, rec, dev.mem[5*testBlockBytes:6*testBlockBytes])
	require.Zero(t, s.Stats().Pinned)
}

// A load verifies every chunk it took from host memory, those after a
// chunk it read back from disk too (whose bytes fetch checked): a corrupt
// one fails the load before any byte reaches the device.
func TestALoadVerifiesItsHostChunksPastAReadBack(t *testing.T) {
	s, e, dev, d := diskFixture(t)
	rec := bytes.Repeat([]byte{0xAB}, testBlockBytes)
	require.True(t, d.Spill("e", "r", crc32.Checksum(rec, castagnoli), rec))
	waitOnDisk(t, d, "r")
	storeChunks(t, e, chunk("h", 1))
	loc, err := s.pool.Locate([]messages.Key{"h"})
	require.NoError(t, err)
	s.arena.Bytes()[loc.Ext[0].Off] ^= 1

	_, err = e.PrepareLoad([]messages.Key{"r", "h"})
	require.NoError(t, err)
	before := bytes.Clone(dev.mem)
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("r", 5), chunk("h", 6)}, nil)
	require.ErrorIs(t, err, ErrCorrupt)
	var ke *hostpool.KeyError
	require.ErrorAs(t, err, &ke)
	require.Equal(t, messages.Key("h"), ke.Key)
	require.Equal(t, before, dev.mem, "nothing reached the device")
	require.Zero(t, s.Stats().Pinned)
}

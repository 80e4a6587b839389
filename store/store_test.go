package store

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

type heapArena []byte

func (a heapArena) Bytes() []byte { return a }
func (a heapArena) Close() error  { return nil }

// memDevice is one segment of device memory on the heap; it counts the
// bytes each direction moved.
type memDevice struct {
	mem     []byte
	in, out int64
	fail    error
}

func (d *memDevice) SegmentSize(int) int64 { return int64(len(d.mem)) }
func (d *memDevice) Close() error          { return nil }
func (d *memDevice) Copy(dir backend.Direction, a backend.Arena, rs []backend.Range) error {
	if d.fail != nil {
		return d.fail
	}
	pool := a.Bytes()
	for _, r := range rs {
		dev := d.mem[r.SegOffset : r.SegOffset+r.Len]
		host := pool[r.PoolOff : r.PoolOff+r.Len]
		if dir == backend.DeviceToHost {
			copy(host, dev)
			d.out += r.Len
		} else {
			copy(dev, host)
			d.in += r.Len
		}
	}
	return nil
}

func fixture(t *testing.T, bpc int, poolBytes, pageBytes int64) (*Store, *Engine, *memDevice, *metrics.Pool) {
	t.Helper()
	l := mustLayout(t, bpc, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &memDevice{mem: make([]byte, 64*testBlockBytes)}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	m := metrics.NewPool(nil)
	s := New(heapArena(make([]byte, poolBytes)), pageBytes, nil, m)
	return s, s.Engine("e", l, dev), dev, m
}

func chunk(key string, ids ...messages.BlockID) sched.JobChunk {
	return sched.JobChunk{Key: messages.Key(key), Blocks: ids}
}

func storeChunks(t *testing.T, e *Engine, chunks ...sched.JobChunk) {
	t.Helper()
	keys, sizes := keysOf(chunks), make([]int64, len(chunks))
	for i := range sizes {
		sizes[i] = e.lay.Groups[0].ChunkBytes
	}
	prep, err := e.PrepareStore(keys, sizes)
	require.NoError(t, err)
	require.Len(t, prep.Keys, len(keys))
	require.NoError(t, e.Copy(backend.DeviceToHost, chunks, nil))
}

// A stored chunk's checksum is the CRC-32C of its bytes in the pool, taken
// as the store completes, and a load verifies it; a chunk cut into pieces
// (3 KiB chunks in 1 KiB pages) round-trips byte for byte.
func TestStoreChecksumsAndLoadVerifies(t *testing.T) {
	s, e, dev, m := fixture(t, 48, 64<<10, 1<<10) // 48 blocks * 64 B = 3 KiB chunks
	ids := func(first messages.BlockID) []messages.BlockID {
		out := make([]messages.BlockID, 48)
		for i := range out {
			out[i] = first + messages.BlockID(i)%12 // 12 distinct blocks, repeated
		}
		return out
	}
	storeChunks(t, e, chunk("k1", ids(1)...))
	require.True(t, s.Ready("k1"))
	loc, err := s.pool.Locate([]messages.Key{"k1"})
	ext, sums := loc.Ext, loc.Sums
	require.NoError(t, err)
	require.Greater(t, len(ext), 1, "the chunk spans pieces")
	var want []byte
	for _, b := range ids(1) {
		want = append(want, dev.mem[int(b)*testBlockBytes:int(b+1)*testBlockBytes]...)
	}
	require.Equal(t, crc32.Checksum(want, castagnoli), sums[0])

	_, err = e.PrepareLoad([]messages.Key{"k1"})
	require.NoError(t, err)
	target := ids(13)[:48]
	for i := range target {
		target[i] = 13 + messages.BlockID(i%12) // 12 fresh blocks (a repeated id gets the last write)
	}
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("k1", target...)}, nil))
	for i := 36; i < 48; i++ { // the last write of each target block is chunk block i
		b := target[i]
		require.Equal(t, want[i*testBlockBytes:(i+1)*testBlockBytes], dev.mem[int(b)*testBlockBytes:int(b+1)*testBlockBytes])
	}
	require.Zero(t, s.Stats().Pinned)
	require.Positive(t, testutil.ToFloat64(m.ChecksumTime.WithLabelValues("GPU_to_CPU")), "checksum time counted")
	require.Positive(t, testutil.ToFloat64(m.ChecksumTime.WithLabelValues("CPU_to_GPU")), "verify time counted")
}

// PROTOCOL.md "Integrity": a corrupt chunk fails the load with ErrCorrupt in
// a KeyError naming it, before any byte moves; it is dropped and counted;
// the other keys of the load are unpinned and stay.
func TestCorruptChunkFailsLoadBeforeAnyCopy(t *testing.T) {
	s, e, dev, m := fixture(t, 2, 16<<10, 0)
	storeChunks(t, e, chunk("a", 1, 2), chunk("b", 3, 4))
	loc, err := s.pool.Locate([]messages.Key{"b"})
	ext := loc.Ext
	require.NoError(t, err)
	s.arena.Bytes()[ext[0].Off+5] ^= 1

	_, err = e.PrepareLoad([]messages.Key{"a", "b"})
	require.NoError(t, err)
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 10, 11), chunk("b", 12, 13)}, nil)
	require.ErrorIs(t, err, ErrCorrupt)
	var ke *hostpool.KeyError
	require.True(t, errors.As(err, &ke))
	require.Equal(t, messages.Key("b"), ke.Key)
	require.Zero(t, dev.in, "no byte reached the device")
	require.False(t, s.Ready("b"), "dropped")
	require.True(t, s.Ready("a"))
	require.Zero(t, s.Stats().Pinned)
	require.Equal(t, 1.0, testutil.ToFloat64(m.Corrupt))
}

// The store's errors name a key as P.E.stored announces it (hash, then
// group: sched.WireKey), never with the node's namespace number the pool
// key starts with, which engines and routers never see; the KeyError's Key
// stays the pool key (the node waits on it).
func TestErrorsNameTheOffloadKeyNotThePoolKey(t *testing.T) {
	s, e, _, _ := fixture(t, 2, 16<<10, 0)
	k := sched.Key(7, "hash-one", 0)
	wire := fmt.Sprintf("key %x:", string(sched.WireKey(k)))
	storeChunks(t, e, sched.JobChunk{Key: k, Blocks: []messages.BlockID{1, 2}})
	loc, err := s.pool.Locate([]messages.Key{k})
	require.NoError(t, err)
	s.arena.Bytes()[loc.Ext[0].Off] ^= 1
	_, err = e.PrepareLoad([]messages.Key{k})
	require.NoError(t, err)
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{{Key: k, Blocks: []messages.BlockID{3, 4}}}, nil)
	require.ErrorIs(t, err, ErrCorrupt)
	require.Contains(t, err.Error(), wire, "a corrupt chunk")
	var ke *hostpool.KeyError
	require.ErrorAs(t, err, &ke)
	require.Equal(t, k, ke.Key)

	_, err = e.PrepareLoad([]messages.Key{k}) // dropped as corrupt: a miss
	require.ErrorIs(t, err, hostpool.ErrNotReady)
	require.Contains(t, err.Error(), wire, "a missing chunk")
}

// named runs on every decision and copy, nearly always with no error: that
// costs no allocation (an errors.As target escapes, so it is declared only
// for an error).
func TestNamedAllocatesNothingWithoutAnError(t *testing.T) {
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = named(nil) }))
}

// A failed store copy frees its room; a cancelled one (Abort) too; a
// cancelled load is unpinned.
func TestFailedAndAbortedJobsComplete(t *testing.T) {
	s, e, dev, _ := fixture(t, 1, 4<<10, 0)
	prep, err := e.PrepareStore([]messages.Key{"x", "y"}, []int64{64, 64})
	require.NoError(t, err)
	require.Len(t, prep.Keys, 2)
	dev.fail = errors.New("dma fault")
	require.ErrorContains(t, e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("x", 1)}, nil), "dma fault")
	e.Abort(backend.DeviceToHost, []sched.JobChunk{chunk("y", 2)})
	require.Zero(t, s.Stats().Used)
	dev.fail = nil
	storeChunks(t, e, chunk("z", 3))
	_, err = e.PrepareLoad([]messages.Key{"z"})
	require.NoError(t, err)
	require.Equal(t, 1, s.Stats().Pinned)
	e.Abort(backend.HostToDevice, []sched.JobChunk{chunk("z", 4)})
	require.Zero(t, s.Stats().Pinned)
}

// A store job whose keys the pool cannot locate (a bug: its keys are
// pending until it completes; here one was never given room) fails and
// still completes: its other chunks' room is freed, none left pending.
func TestAStoreJobItsPoolCannotLocateStillCompletes(t *testing.T) {
	s, e, _, _ := fixture(t, 1, 4<<10, 0)
	_, err := e.PrepareStore([]messages.Key{"x"}, []int64{64})
	require.NoError(t, err)
	err = e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("x", 1), chunk("never", 2)}, nil)
	require.ErrorIs(t, err, hostpool.ErrNotReady)
	require.Zero(t, s.Stats().Pending, "x left pending")
	require.Zero(t, s.Stats().Used)
}

// A chunk is a lookup hit only once its store completed: while its copy
// fills it (pending) it is neither Store.Ready nor Engine.Ready
// (PROTOCOL.md "lookup" stops at it).
func TestAChunkBeingStoredIsNoLookupHit(t *testing.T) {
	s, e, _, _ := fixture(t, 1, 4<<10, 0)
	_, err := e.PrepareStore([]messages.Key{"x"}, []int64{e.lay.Groups[0].ChunkBytes})
	require.NoError(t, err)
	require.False(t, s.Ready("x"), "pending: a hit")
	require.False(t, e.Ready("x"), "pending: a hit")
	require.NoError(t, e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("x", 1)}, nil))
	require.True(t, s.Ready("x"))
	require.True(t, e.Ready("x"))
}

// A key whose group is past the engine's layout (its last group + 1, the
// first index out of range) is no hit for that engine's lookup, even when
// another engine stored a chunk under it.
func TestAKeyOfAGroupPastTheLayoutIsNoHit(t *testing.T) {
	s, e, _, _ := fixture(t, 1, 4<<10, 0)
	key := sched.Key(0, "h", len(e.lay.Groups))
	prep, err := e.PrepareStore([]messages.Key{key}, []int64{64})
	require.NoError(t, err)
	s.pool.CompleteStore(prep.Keys, []uint32{0})
	require.True(t, s.Ready(key))
	require.NotPanics(t, func() { require.False(t, e.Ready(key)) })
}

// A chunk larger than a tile (20 blocks of 64 KiB = 1.25 MiB, with a null
// block, across two pieces) is copied a window at a time: its checksum is
// still the CRC-32C of all its bytes in order, it loads back byte for byte,
// and once corrupt none of it reaches the device.
func TestLargeChunkWindows(t *testing.T) {
	const bb = 64 << 10
	l := mustLayout(t, 20, messages.Region{BlockStride: bb, BlockBytes: bb})
	dev := &memDevice{mem: make([]byte, 48*bb)}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	s := New(heapArena(bytes.Repeat([]byte{0xEE}, 4<<20)), 1<<20, nil, metrics.NewPool(nil)) // not zeros: a null block's place must be cleared
	e := s.Engine("e", l, dev)
	src := make([]messages.BlockID, 20)
	for i := range src {
		src[i] = messages.BlockID(1 + i)
	}
	src[7] = 0 // null: not copied, its place kept
	prep, err := e.PrepareStore([]messages.Key{"big"}, []int64{20 * bb})
	require.NoError(t, err)
	require.Len(t, prep.Keys, 1)
	require.NoError(t, e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("big", src...)}, nil))
	loc, err := s.pool.Locate([]messages.Key{"big"})
	ext, sums := loc.Ext, loc.Sums
	require.NoError(t, err)
	require.Len(t, ext, 2, "a page and a 256 KiB slot")
	var logical []byte
	for _, x := range ext {
		logical = append(logical, s.arena.Bytes()[x.Off:x.Off+x.Len]...)
	}
	require.Equal(t, crc32.Checksum(logical, castagnoli), sums[0])
	for i, b := range src {
		if b != 0 {
			require.Equal(t, dev.mem[int(b)*bb:int(b+1)*bb], logical[i*bb:(i+1)*bb], "block %d", i)
		} else {
			require.Equal(t, make([]byte, bb), logical[i*bb:(i+1)*bb], "null block %d is zeros", i)
		}
	}

	dst := make([]messages.BlockID, 20)
	for i := range dst {
		dst[i] = messages.BlockID(25 + i%20)
	}
	_, err = e.PrepareLoad([]messages.Key{"big"})
	require.NoError(t, err)
	dev.in = 0
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("big", dst...)}, nil))
	require.Equal(t, int64(20*bb), dev.in)
	for i := range dst {
		require.Equal(t, logical[i*bb:(i+1)*bb], dev.mem[int(dst[i])*bb:int(dst[i]+1)*bb], "block %d", i)
	}

	s.arena.Bytes()[ext[1].Off+ext[1].Len-1] ^= 0x80 // the last byte of the chunk
	_, err = e.PrepareLoad([]messages.Key{"big"})
	require.NoError(t, err)
	dev.in = 0
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("big", dst...)}, nil)
	require.ErrorIs(t, err, ErrCorrupt)
	require.Zero(t, dev.in, "no window of a corrupt chunk is copied")
	require.False(t, s.Ready("big"))
	require.Zero(t, s.Stats().Used)
}

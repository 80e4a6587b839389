package store

import (
	"errors"
	"hash/crc32"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
)

// A chunk crosses stores: ReadChunk gives its bytes and stored checksum;
// FillRemote puts them into another store's room and makes them ready with
// that checksum (a chunk cut into pieces round-trips), pinned until
// UnpinRemote.
func TestChunkCrossesStoresWithItsChecksum(t *testing.T) {
	src, se, _, _ := fixture(t, 48, 64<<10, 1<<10) // 3 KiB chunks in 1 KiB pages
	storeChunks(t, se, chunk("k", make([]messages.BlockID, 48)...))
	data, sum, err := src.ReadChunk("k")
	require.NoError(t, err)
	require.Len(t, data, 48*testBlockBytes)
	require.Equal(t, crc32.Checksum(data, castagnoli), sum)
	require.Zero(t, src.Stats().Pinned, "the read unpinned")

	dst, de, _, _ := fixture(t, 48, 64<<10, 1<<10)
	prep, err := de.PrepareStore([]messages.Key{"k"}, []int64{int64(len(data))})
	require.NoError(t, err)
	require.Len(t, prep.Keys, 1)
	require.NoError(t, dst.FillRemote("e", "k", data, sum))
	require.True(t, dst.Ready("k"))
	require.Equal(t, 1, dst.Stats().Pinned, "filled pinned: no store evicts it before its load pins it")
	dst.UnpinRemote([]messages.Key{"k"})
	require.Zero(t, dst.Stats().Pinned)
	again, sum2, err := dst.ReadChunk("k")
	require.NoError(t, err)
	require.Equal(t, data, again)
	require.Equal(t, sum, sum2)
}

// Bad input changes nothing: a chunk whose bytes do not match the sent
// checksum, or of the wrong size, is never made ready and its room is
// freed; a key never prepared is refused.
func TestFillRemoteRefusesBadChunks(t *testing.T) {
	s, e, _, _ := fixture(t, 2, 16<<10, 0)
	size := e.lay.Groups[0].ChunkBytes
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i)
	}
	sum := crc32.Checksum(data, castagnoli)
	for _, tc := range []struct {
		name string
		data []byte
		sum  uint32
		want error
	}{
		{"checksum", data, sum ^ 1, ErrCorrupt},
		{"size", data[1:], sum, hostpool.ErrBadSize},
	} {
		_, err := e.PrepareStore([]messages.Key{"k"}, []int64{size})
		require.NoError(t, err)
		err = s.FillRemote("e", "k", tc.data, tc.sum)
		require.True(t, errors.Is(err, tc.want), "%s: %v", tc.name, err)
		st, _ := s.Lookup("k")
		require.Equal(t, hostpool.Absent, st, "%s: room freed", tc.name)
	}
	require.Error(t, s.FillRemote("e", "never", data, sum))
	require.Zero(t, s.Stats().Pending)
	require.Zero(t, s.Stats().Pinned, "a refused chunk is not pinned")
}

// FillRemote writes only into room given to a pending key: a key already
// ready (stored meanwhile by another copy, pinned here by a load copying
// it out) is refused and its bytes are left as they are.
func TestFillRemoteNeverWritesOverAReadyChunk(t *testing.T) {
	s, e, _, _ := fixture(t, 2, 16<<10, 0)
	storeChunks(t, e, chunk("k", 1, 2))
	want, sum, err := s.ReadChunk("k")
	require.NoError(t, err)
	_, err = e.PrepareLoad([]messages.Key{"k"}) // a load holds it
	require.NoError(t, err)

	other := make([]byte, len(want))
	require.Error(t, s.FillRemote("e", "k", other, crc32.Checksum(other, castagnoli)))
	require.Equal(t, 1, s.Stats().Pinned, "the load's pin alone")
	s.UnpinRemote([]messages.Key{"k"})
	got, sum2, err := s.ReadChunk("k")
	require.NoError(t, err)
	require.Equal(t, want, got, "the ready chunk's bytes were written over")
	require.Equal(t, sum, sum2)
}

// A chunk corrupted in host memory is not served: ReadChunk drops it and
// counts it.
func TestReadChunkDropsACorruptChunk(t *testing.T) {
	s, e, _, m := fixture(t, 2, 16<<10, 0)
	storeChunks(t, e, chunk("a", 1, 2))
	loc, err := s.pool.Locate([]messages.Key{"a"})
	require.NoError(t, err)
	s.arena.Bytes()[loc.Ext[0].Off+3] ^= 1
	_, _, err = s.ReadChunk("a")
	require.True(t, errors.Is(err, ErrCorrupt), "%v", err)
	require.False(t, s.Ready("a"))
	require.Equal(t, 1.0, testutil.ToFloat64(m.Corrupt))
}

// hookArena runs onBytes, once, at the next call to Bytes: the moment a copy
// starts reading or writing the arena.
type hookArena struct {
	b       []byte
	onBytes func()
}

func (a *hookArena) Bytes() []byte {
	if f := a.onBytes; f != nil {
		a.onBytes = nil
		f()
	}
	return a.b
}
func (a *hookArena) Close() error { return nil }

// ReadChunk copies its chunk out under its pin: a store deciding while the
// bytes are read, into a pool the chunk fills, finds no room rather than
// evicting the chunk and writing over the bytes being served.
func TestReadChunkCopiesItsChunkPinned(t *testing.T) {
	l := mustLayout(t, 2, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	size := l.Groups[0].ChunkBytes
	arena := &hookArena{b: make([]byte, size)}
	dev := &memDevice{mem: make([]byte, 64*testBlockBytes)}
	for i := range dev.mem {
		dev.mem[i] = byte(i)
	}
	s := New(arena, size, nil, metrics.NewPool(nil))
	e := s.Engine("e", l, dev)
	storeChunks(t, e, chunk("a", 1, 2))
	want := slices.Clone(arena.b)

	var during error
	arena.onBytes = func() {
		var prep hostpool.Prepared
		if prep, during = e.PrepareStore([]messages.Key{"b"}, []int64{size}); during == nil {
			for _, x := range prep.Ext {
				clear(arena.b[x.Off : x.Off+x.Len]) // b's copy, over a's bytes
			}
		}
	}
	got, _, err := s.ReadChunk("a")
	require.ErrorIs(t, during, hostpool.ErrNoRoom, "a store evicted the chunk being read")
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Zero(t, s.Stats().Pinned)
}

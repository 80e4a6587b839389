package store

import (
	"bytes"
	"hash/crc32"
	"math/rand/v2"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// A store copies only a chunk's non-null blocks. The room it is given may
// have held an evicted chunk of another engine: none of those bytes may be
// handed out under the new chunk's key. Here mal's chunk takes the slot of
// vic's, with three null blocks, and mal then loads it into four blocks.
// (A full-attention group: in the other kinds sched stores no chunk with a
// null block, docs/PROTOCOL.md "block id 0"; the store zeroes them all the
// same.)
func TestANullBlockNeverCarriesTheSlotsEarlierBytes(t *testing.T) {
	l := mustLayout(t, 4, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	chunkBytes := l.Groups[0].ChunkBytes
	s := New(heapArena(make([]byte, chunkBytes)), chunkBytes, nil, metrics.NewPool(nil)) // room for one chunk
	vicDev := &memDevice{mem: bytes.Repeat([]byte{0xAA}, 64*testBlockBytes)}
	malDev := &memDevice{mem: make([]byte, 64*testBlockBytes)}
	vic, mal := s.Engine("vic", l, vicDev), s.Engine("mal", l, malDev)

	storeChunks(t, vic, chunk("\x00\x00\x00\x01vic-key", 1, 2, 3, 4))
	storeChunks(t, mal, chunk("\x00\x00\x00\x02mal-key", 0, 0, 0, 5)) // evicts vic's, takes its slot
	require.False(t, s.Ready("\x00\x00\x00\x01vic-key"))

	_, err := mal.PrepareLoad([]messages.Key{"\x00\x00\x00\x02mal-key"})
	require.NoError(t, err)
	require.NoError(t, mal.Copy(backend.HostToDevice,
		[]sched.JobChunk{chunk("\x00\x00\x00\x02mal-key", 10, 11, 12, 13)}, nil))
	require.Equal(t, make([]byte, 3*testBlockBytes), malDev.mem[10*testBlockBytes:13*testBlockBytes],
		"the places of the null blocks load as zeros, not as vic's KV")
}

// For any pattern of null blocks, in a group of two regions whose chunk the
// pool cuts into pieces, a stored chunk's bytes are its blocks' device bytes
// where they are not null and zeros where they are (the arena held other
// bytes before), and its checksum is theirs.
func TestAStoredChunkIsItsBlocksAndZeros(t *testing.T) {
	const bb = 48 // two regions of 48 and 16 bytes: a block is 64
	regions := []messages.Region{{BlockStride: bb, BlockBytes: bb}, {Segment: 0, Offset: 64 * bb, BlockStride: 16, BlockBytes: 16}}
	l := mustLayout(t, 6, regions...)
	dev := &memDevice{mem: make([]byte, 64*bb+64*16)}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7+i/251) | 1 // never zero: a zero read back came from clearing
	}
	chunkBytes := l.Groups[0].ChunkBytes
	check := func(mask uint8, seed uint64) bool {
		arena := bytes.Repeat([]byte{0xEE}, int(2*chunkBytes))
		s := New(heapArena(arena), chunkBytes/2, nil, metrics.NewPool(nil)) // pages of half a chunk: pieces
		e := s.Engine("e", l, dev)
		rng := rand.New(rand.NewPCG(seed, 1))
		ids := make([]messages.BlockID, 6)
		for i := range ids {
			if mask&(1<<i) != 0 || i == len(ids)-1 { // the last block is never null
				ids[i] = messages.BlockID(1 + rng.IntN(62))
			}
		}
		storeChunks(t, e, chunk("k", ids...))
		loc, err := s.pool.Locate([]messages.Key{"k"})
		require.NoError(t, err)
		var got []byte
		for _, x := range loc.Ext {
			got = append(got, arena[x.Off:x.Off+x.Len]...)
		}
		var want []byte
		for _, b := range ids {
			for _, r := range regions {
				if b == 0 {
					want = append(want, make([]byte, r.BlockBytes)...)
					continue
				}
				off := r.Offset + int64(b)*r.BlockStride
				want = append(want, dev.mem[off:off+r.BlockBytes]...)
			}
		}
		return bytes.Equal(want, got) && loc.Sums[0] == crc32.Checksum(want, castagnoli)
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 300}))
}

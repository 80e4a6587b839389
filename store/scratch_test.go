package store

import (
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Copy reuses its working memory across jobs: store jobs of random sizes,
// copying into the room their decision reserved (JobChunk.Room/Slot, as
// sched builds them) or locating it in the pool, run back to back; every
// chunk must land byte for byte with its own checksum, whatever the job
// before it left in the scratch.
func TestCopyScratchCarriesNothingBetweenJobs(t *testing.T) {
	s, e, dev, _ := fixture(t, 2, 64<<10, 1<<10) // 2 blocks * 64 B = 128 B chunks, room for 512
	rng := rand.New(rand.NewPCG(7, 11))
	for job := range 300 {
		n := 1 + rng.IntN(12)
		if job%50 == 49 {
			n = 40 // now and then a big one, then small ones again
		}
		chunks := make([]sched.JobChunk, n)
		keys, sizes := make([]messages.Key, n), make([]int64, n)
		for i := range chunks {
			keys[i] = messages.Key(fmt.Sprintf("j%d-%d", job, i))
			b := messages.BlockID(1 + rng.IntN(60))
			chunks[i] = chunk(string(keys[i]), b, b+1)
			sizes[i] = e.lay.Groups[0].ChunkBytes
		}
		prep, err := e.PrepareStore(keys, sizes)
		require.NoError(t, err)
		require.Len(t, prep.Keys, n)
		if job%3 != 0 { // reserved room, as a decision hands it on
			for i := range chunks {
				chunks[i].Room, chunks[i].Slot = prep.Chunk(i), prep.Slots[i]
			}
		}
		require.NoError(t, e.Copy(backend.DeviceToHost, chunks, nil))
		loc, err := s.pool.Locate(keys)
		require.NoError(t, err)
		for i, c := range chunks {
			var got, want []byte
			for _, x := range loc.Chunk(i) {
				got = append(got, s.arena.Bytes()[x.Off:x.Off+x.Len]...)
			}
			for _, b := range c.Blocks {
				want = append(want, dev.mem[int(b)*testBlockBytes:int(b+1)*testBlockBytes]...)
			}
			require.Equal(t, want, got, "job %d chunk %d bytes", job, i)
			require.Equal(t, crc32.Checksum(want, castagnoli), loc.Sums[i], "job %d chunk %d checksum", job, i)
			require.True(t, s.Ready(keys[i]))
		}
	}
}

// A store job copies into the room its decision reserved (JobChunk.Room),
// without locating its keys again: handed two chunks' rooms swapped, the
// copy writes each chunk's bytes where it was told, so each key's room
// holds the other chunk's bytes. (A decision never swaps rooms: this only
// shows which room the copy trusts.)
func TestCopyWritesIntoTheReservedRoom(t *testing.T) {
	s, e, dev, _ := fixture(t, 2, 64<<10, 1<<10)
	keys := []messages.Key{"x0", "x1"}
	chunks := []sched.JobChunk{chunk("x0", 1, 2), chunk("x1", 5, 6)}
	size := e.lay.Groups[0].ChunkBytes
	prep, err := e.PrepareStore(keys, []int64{size, size})
	require.NoError(t, err)
	chunks[0].Room, chunks[0].Slot = prep.Chunk(1), prep.Slots[1]
	chunks[1].Room, chunks[1].Slot = prep.Chunk(0), prep.Slots[0]
	require.NoError(t, e.Copy(backend.DeviceToHost, chunks, nil))
	loc, err := s.pool.Locate(keys)
	require.NoError(t, err)
	bytesOf := func(ext []hostpool.Extent) []byte {
		var b []byte
		for _, x := range ext {
			b = append(b, s.arena.Bytes()[x.Off:x.Off+x.Len]...)
		}
		return b
	}
	blocks := func(ids ...int) []byte {
		var b []byte
		for _, id := range ids {
			b = append(b, dev.mem[id*testBlockBytes:(id+1)*testBlockBytes]...)
		}
		return b
	}
	require.Equal(t, blocks(5, 6), bytesOf(loc.Chunk(0)), "x0's room got x1's bytes: the reserved room was used")
	require.Equal(t, blocks(1, 2), bytesOf(loc.Chunk(1)))
}

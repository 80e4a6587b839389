package store

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// callsDevice is memDevice counting its device calls (one goroutine);
// with failAt set, that call fails (errDMA) and copies nothing.
type callsDevice struct {
	memDevice
	calls, failAt int
}

func (d *callsDevice) Copy(dir backend.Direction, a backend.Arena, rs []backend.Range) error {
	d.calls++
	if d.calls == d.failAt {
		return errDMA
	}
	return d.memDevice.Copy(dir, a, rs)
}

var errDMA = errors.New("dma fault")

var errGone = errors.New("engine gone quiet")

const liveBB = 64 << 10 // block bytes: a 4-block chunk is half a tile, a 12-block one a tile and a half

// liveJob is a job's shape for the live-check tests: small chunks two to a
// tile over three tiles, or one chunk of two windows (copyLarge).
type liveJob struct {
	name     string
	bpc, n   int
	devCalls int // device calls of the whole job, each way
}

var liveJobs = []liveJob{{"small chunks", 4, 6, 3}, {"large chunk", 12, 1, 2}}

func liveFixture(t *testing.T, j liveJob) (*Store, *Engine, *callsDevice, []sched.JobChunk) {
	t.Helper()
	l := mustLayout(t, j.bpc, messages.Region{BlockStride: liveBB, BlockBytes: liveBB})
	dev := &callsDevice{memDevice: memDevice{mem: make([]byte, 64*liveBB)}}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	s := New(heapArena(make([]byte, 4<<20)), 1<<20, nil, metrics.NewPool(nil))
	chunks := make([]sched.JobChunk, j.n)
	for i := range chunks {
		ids := make([]messages.BlockID, j.bpc)
		for b := range ids {
			ids[b] = messages.BlockID(1 + i*j.bpc + b) // blocks 1..24 at most
		}
		chunks[i] = chunk(fmt.Sprintf("k%d", i), ids...)
	}
	return s, s.Engine("e", l, dev), dev, chunks
}

// targets is chunks with their blocks moved to 32 on (a load's destination).
func targets(chunks []sched.JobChunk) []sched.JobChunk {
	out := make([]sched.JobChunk, len(chunks))
	for i, c := range chunks {
		ids := make([]messages.BlockID, len(c.Blocks))
		for b, id := range c.Blocks {
			ids[b] = 31 + id
		}
		out[i] = chunk(string(c.Key), ids...)
	}
	return out
}

// PROTOCOL.md "Engine silence": a copy running when its engine's silence
// reaches lease/2 is stopped at the next tile, and a store once more before
// it completes. Here the check fails whenever asked, which is first after
// the first device call: the copy stops there with the check's error; a
// store's chunks are freed, none ready (bytes read from blocks the engine
// may reuse never become loadable under their keys), a load's unpinned.
func TestACopyStopsBetweenTilesOnceItsLiveCheckFails(t *testing.T) {
	for _, j := range liveJobs {
		t.Run(j.name+"/store", func(t *testing.T) {
			s, e, dev, chunks := preparedStore(t, j)
			asked := 0
			err := e.Copy(backend.DeviceToHost, chunks, func() error { asked++; return errGone })
			require.ErrorIs(t, err, errGone)
			require.Equal(t, 1, dev.calls, "device calls: the copy goes on past the failed check")
			require.Equal(t, 1, asked)
			storeEndedFailed(t, s, e, chunks)
		})
		t.Run(j.name+"/load", func(t *testing.T) {
			s, e, dev, chunks := preparedLoad(t, j)
			err := e.Copy(backend.HostToDevice, targets(chunks), func() error { return errGone })
			require.ErrorIs(t, err, errGone)
			require.Equal(t, 1, dev.calls, "device calls: the copy goes on past the failed check")
			require.Less(t, dev.in, int64(j.n*j.bpc*liveBB))
			loadEndedFailed(t, s, chunks)
		})
	}
}

// A device call that fails after the job's first tile went through ends
// the job as a failed copy, in both copy paths (tiles of small chunks,
// windows of one large chunk): a store's chunks are freed, none ready, and
// the room is there for the next try; a load's chunks are unpinned and
// stay ready.
func TestADeviceFaultMidJobCompletesItAsFailed(t *testing.T) {
	for _, j := range liveJobs {
		t.Run(j.name+"/store", func(t *testing.T) {
			s, e, dev, chunks := preparedStore(t, j)
			dev.failAt = 2
			require.ErrorIs(t, e.Copy(backend.DeviceToHost, chunks, nil), errDMA)
			require.Equal(t, 2, dev.calls, "no device call after the fault")
			storeEndedFailed(t, s, e, chunks) // the next try's calls are past failAt
		})
		t.Run(j.name+"/load", func(t *testing.T) {
			s, e, dev, chunks := preparedLoad(t, j)
			dev.failAt = 2
			require.ErrorIs(t, e.Copy(backend.HostToDevice, targets(chunks), nil), errDMA)
			require.Equal(t, 2, dev.calls, "no device call after the fault")
			loadEndedFailed(t, s, chunks)
		})
	}
}

// preparedStore is liveFixture with room prepared for every chunk.
func preparedStore(t *testing.T, j liveJob) (*Store, *Engine, *callsDevice, []sched.JobChunk) {
	t.Helper()
	s, e, dev, chunks := liveFixture(t, j)
	prep, err := e.PrepareStore(keysOf(chunks), sizesOf(e, chunks))
	require.NoError(t, err)
	require.Len(t, prep.Keys, len(chunks))
	return s, e, dev, chunks
}

// storeEndedFailed checks a store that ended as a failed copy: none of its
// chunks ready, their room freed, and there again for the next try.
func storeEndedFailed(t *testing.T, s *Store, e *Engine, chunks []sched.JobChunk) {
	t.Helper()
	for _, c := range chunks {
		require.False(t, s.Ready(c.Key), "%s ready after its copy ended early", c.Key)
	}
	st := s.Stats()
	require.Zero(t, st.Used, "chunks left in the pool")
	require.Zero(t, st.Data, "room not freed")
	prep, err := e.PrepareStore(keysOf(chunks), sizesOf(e, chunks))
	require.NoError(t, err)
	require.Len(t, prep.Keys, len(chunks))
	require.NoError(t, e.Copy(backend.DeviceToHost, chunks, nil))
}

// preparedLoad is liveFixture with every chunk stored and pinned for a
// load, and the device's counts zeroed.
func preparedLoad(t *testing.T, j liveJob) (*Store, *Engine, *callsDevice, []sched.JobChunk) {
	t.Helper()
	s, e, dev, chunks := liveFixture(t, j)
	storeChunks(t, e, chunks...)
	_, err := e.PrepareLoad(keysOf(chunks))
	require.NoError(t, err)
	require.Equal(t, len(chunks), s.Stats().Pinned)
	dev.calls, dev.in = 0, 0
	return s, e, dev, chunks
}

// loadEndedFailed checks a load that ended early: its chunks unpinned and
// still ready.
func loadEndedFailed(t *testing.T, s *Store, chunks []sched.JobChunk) {
	t.Helper()
	require.Zero(t, s.Stats().Pinned, "a load that ended early left its chunks pinned")
	for _, c := range chunks {
		require.True(t, s.Ready(c.Key), "a load that ended early dropped %s", c.Key)
	}
}

// A store's last tiles are copied after the last check between tiles: the
// check is asked once more before the pool completes, so a store whose
// engine falls silent during its last (here: only) device call is not made
// ready either.
func TestAStoreIsCheckedBeforeItCompletes(t *testing.T) {
	s, e, dev, chunks := preparedStore(t, liveJob{bpc: 4, n: 1})
	err := e.Copy(backend.DeviceToHost, chunks, func() error {
		require.Equal(t, 1, dev.calls, "asked before the copy's only device call")
		return errGone
	})
	require.ErrorIs(t, err, errGone)
	require.False(t, s.Ready(chunks[0].Key))
	require.Zero(t, s.Stats().Used)
}

// A load that reads chunks back from disk first is checked before its first
// device call too: the disk read takes time.
func TestALoadReadFromDiskIsCheckedBeforeItsFirstTile(t *testing.T) {
	l := mustLayout(t, 1, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &callsDevice{memDevice: memDevice{mem: make([]byte, 8*testBlockBytes)}}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	s := New(heapArena(make([]byte, testBlockBytes)), testBlockBytes, d, metrics.NewPool(nil)) // room for one chunk
	e := s.Engine("e", l, dev)
	storeChunks(t, e, chunk("a", 1))
	storeChunks(t, e, chunk("b", 2)) // evicts a, written to disk
	waitOnDisk(t, d, "a")
	if st, _ := s.pool.Lookup("a"); st == hostpool.Ready {
		t.Fatal("a still in host memory")
	}
	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	dev.calls = 0
	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, func() error { return errGone })
	require.ErrorIs(t, err, errGone)
	require.Zero(t, dev.calls, "a device call after the disk read, unchecked")
	st := s.Stats()
	require.Zero(t, st.Pinned)
	require.Zero(t, st.Pending)
}

// A check that never fails changes nothing: the same bytes and checksums
// land in the pool as with none, and load back byte for byte. It is asked
// once per tile, not per chunk: between device calls, and once more
// before a store completes.
func TestALiveCheckThatHoldsChangesNothing(t *testing.T) {
	for _, j := range liveJobs {
		t.Run(j.name, func(t *testing.T) {
			s0, e0, _, chunks := liveFixture(t, j)
			storeChunks(t, e0, chunks...)       // no check
			s, e, dev, _ := preparedStore(t, j) // the same chunks
			asked := 0
			live := func() error { asked++; return nil }
			require.NoError(t, e.Copy(backend.DeviceToHost, chunks, live))
			require.Equal(t, j.devCalls, asked, "store: asked between %d device calls and before completing", j.devCalls)
			for _, c := range chunks {
				require.True(t, s.Ready(c.Key))
				want, got := poolChunk(t, s0, c.Key), poolChunk(t, s, c.Key)
				require.True(t, bytes.Equal(want.bytes, got.bytes), "%s: bytes differ", c.Key)
				require.Equal(t, want.sum, got.sum, "%s: checksum", c.Key)
			}

			_, err := e.PrepareLoad(keysOf(chunks))
			require.NoError(t, err)
			asked, dev.calls = 0, 0
			dst := targets(chunks)
			require.NoError(t, e.Copy(backend.HostToDevice, dst, live))
			require.Equal(t, j.devCalls, dev.calls)
			require.Equal(t, j.devCalls-1, asked, "load: asked between device calls")
			for i, c := range chunks {
				for b, id := range c.Blocks {
					to := dst[i].Blocks[b]
					require.Equal(t, dev.mem[int(id)*liveBB:int(id+1)*liveBB], dev.mem[int(to)*liveBB:int(to+1)*liveBB],
						"%s block %d", c.Key, b)
				}
			}
			require.Zero(t, s.Stats().Pinned)
		})
	}
}

type pooled struct {
	bytes []byte
	sum   uint32
}

// poolChunk is key's logical bytes in s's pool and its checksum.
func poolChunk(t *testing.T, s *Store, key messages.Key) pooled {
	t.Helper()
	loc, err := s.pool.Locate([]messages.Key{key})
	require.NoError(t, err)
	var b []byte
	for _, x := range loc.Ext {
		b = append(b, s.arena.Bytes()[x.Off:x.Off+x.Len]...)
	}
	return pooled{bytes: b, sum: loc.Sums[0]}
}

func sizesOf(e *Engine, chunks []sched.JobChunk) []int64 {
	sizes := make([]int64, len(chunks))
	for i := range sizes {
		sizes[i] = e.lay.Groups[0].ChunkBytes
	}
	return sizes
}

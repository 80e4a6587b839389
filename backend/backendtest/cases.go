package backendtest

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
)

type rng = backend.Range

func testAllocArena(t *testing.T, h Harness) {
	b := h.New(t)
	for _, n := range []int64{0, -1, math.MinInt64} {
		_, err := b.AllocArena(n)
		require.Error(t, err, "AllocArena(%d)", n)
	}
	a, err := b.AllocArena(3*4096 + 1)
	require.NoError(t, err)
	mem := a.Bytes()
	require.GreaterOrEqual(t, len(mem), 3*4096+1)
	copy(mem, pattern(7, int64(len(mem)))) // host memory: plainly writable
	require.Equal(t, pattern(7, int64(len(mem))), a.Bytes())
	require.NoError(t, a.Close())
	require.NoError(t, a.Close(), "second Close")
}

// testStore: device→host copies land exactly on their arena ranges, including
// unaligned ones and ones ending at a segment's or the arena's last byte.
func testStore(t *testing.T, h Harness) {
	w := newWorld(t, h, []int64{64 << 10, 32<<10 + 3}, 64<<10)
	pool := int64(len(w.arena.Bytes()))
	require.NoError(t, w.copy(backend.DeviceToHost,
		rng{Segment: 0, SegOffset: 0, PoolOff: 0, Len: 4096},
		rng{Segment: 1, SegOffset: 100, PoolOff: 4096, Len: 1000},
		rng{Segment: 0, SegOffset: 64<<10 - 7, PoolOff: 8192, Len: 7},
		rng{Segment: 1, SegOffset: 32<<10 + 3 - 512, PoolOff: pool - 512, Len: 512},
	))
	w.verify("after store")
}

// testLoad: host→device copies land exactly on their device ranges.
func testLoad(t *testing.T, h Harness) {
	w := newWorld(t, h, []int64{64 << 10, 32<<10 + 3}, 64<<10)
	require.NoError(t, w.copy(backend.HostToDevice,
		rng{Segment: 1, SegOffset: 0, PoolOff: 5, Len: 4096},
		rng{Segment: 0, SegOffset: 12345, PoolOff: 20000, Len: 3000},
		rng{Segment: 1, SegOffset: 32<<10 + 3 - 1, PoolOff: 0, Len: 1},
	))
	w.verify("after load")
}

// testRoundTrip: a block stored and loaded back into other device offsets
// (another engine's blocks, another segment) arrives intact.
func testRoundTrip(t *testing.T, h Harness) {
	w := newWorld(t, h, []int64{64 << 10, 64 << 10}, 32<<10)
	want := w.segs.Read(0, 4096, 8192)
	require.NoError(t, w.copy(backend.DeviceToHost, rng{Segment: 0, SegOffset: 4096, PoolOff: 1024, Len: 8192}))
	w.verify("after store")
	require.NoError(t, w.copy(backend.HostToDevice,
		rng{Segment: 1, SegOffset: 40000, PoolOff: 1024, Len: 8192},
		rng{Segment: 0, SegOffset: 50000, PoolOff: 1024, Len: 8192},
	))
	w.verify("after load")
	sameBytes(t, want, w.segs.Read(1, 40000, 8192), "round trip into segment 1")
	sameBytes(t, want, w.segs.Read(0, 50000, 8192), "round trip into segment 0")
}

func testEmpty(t *testing.T, h Harness) {
	w := newWorld(t, h, []int64{4096}, 4096)
	for _, dir := range []backend.Direction{backend.DeviceToHost, backend.HostToDevice} {
		require.NoError(t, w.copy(dir))
		// Zero bytes at the very end of both sides is in range.
		require.NoError(t, w.copy(dir, rng{Segment: 0, SegOffset: 4096, PoolOff: int64(len(w.arena.Bytes())), Len: 0}))
	}
	w.verify("after empty copies")
}

// testOutOfRange: every bad range is refused with ErrOutOfRange, and the
// check is all-or-nothing: the good range before it is not copied either.
func testOutOfRange(t *testing.T, h Harness) {
	const segSize, arenaSize = 8192, 8192
	w := newWorld(t, h, []int64{segSize, segSize}, arenaSize)
	pool := int64(len(w.arena.Bytes()))
	bad := []struct {
		name string
		r    rng
	}{
		{"negative segment", rng{Segment: -1, Len: 1}},
		{"segment past the last", rng{Segment: 2, Len: 1}},
		{"negative SegOffset", rng{SegOffset: -1, Len: 1}},
		{"negative PoolOff", rng{PoolOff: -1, Len: 1}},
		{"negative Len", rng{Len: -1}},
		{"one byte past segment end", rng{SegOffset: segSize - 100, Len: 101}},
		{"offset past segment end", rng{SegOffset: segSize + 1, Len: 0}},
		{"longer than segment", rng{Len: segSize + 1}},
		{"one byte past arena end", rng{PoolOff: pool - 100, Len: 101}},
		{"offset past arena end", rng{PoolOff: pool + 1, Len: 0}},
		{"SegOffset+Len overflows", rng{SegOffset: math.MaxInt64, Len: 2}},
		{"PoolOff+Len overflows", rng{PoolOff: math.MaxInt64 - 1, Len: 2}},
		{"huge Len", rng{Len: math.MaxInt64}},
		{"min int64 Len", rng{Len: math.MinInt64}},
	}
	good := rng{Segment: 1, SegOffset: 0, PoolOff: 0, Len: 4096}
	for _, dir := range []backend.Direction{backend.DeviceToHost, backend.HostToDevice} {
		for _, tc := range bad {
			t.Run(fmt.Sprintf("%s/%s", dir, tc.name), func(t *testing.T) {
				w.t = t
				err := w.copy(dir, good, tc.r)
				require.ErrorIs(t, err, backend.ErrOutOfRange)
				w.verify("after refused copy")
			})
		}
	}
}

// testConcurrent: goroutines copying disjoint ranges at once (what the
// transfer actor does) do not disturb each other; run it with -race.
func testConcurrent(t *testing.T, h Harness) {
	const workers, block, rounds = 8, 4096 + 13, 20
	w := newWorld(t, h, []int64{2 * workers * block}, workers*block)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for k := range workers {
		// Worker k owns device slots 2k (source) and 2k+1 (destination) and
		// arena slot k: nothing is shared between workers.
		store := rng{Segment: 0, SegOffset: int64(2*k) * block, PoolOff: int64(k) * block, Len: block}
		load := rng{Segment: 0, SegOffset: int64(2*k+1) * block, PoolOff: int64(k) * block, Len: block}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				if err := w.dev.Copy(backend.DeviceToHost, w.arena, []rng{store}); err != nil {
					errs <- fmt.Errorf("worker %d store: %w", k, err)
					return
				}
				if err := w.dev.Copy(backend.HostToDevice, w.arena, []rng{load}); err != nil {
					errs <- fmt.Errorf("worker %d load: %w", k, err)
					return
				}
			}
		}()
		// The model is sequential; each worker's effect is the same whatever
		// the interleaving because the workers are disjoint.
		w.apply(backend.DeviceToHost, []rng{store})
		w.apply(backend.HostToDevice, []rng{load})
	}
	waitGroup(t, &wg, "concurrent copy workers")
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	w.verify("after concurrent copies")
}

func testCloseThenCopy(t *testing.T, h Harness) {
	w := newWorld(t, h, []int64{4096}, 4096)
	require.NoError(t, w.dev.Close())
	require.NoError(t, w.dev.Close(), "second Close")
	for _, dir := range []backend.Direction{backend.DeviceToHost, backend.HostToDevice} {
		err := w.dev.Copy(dir, w.arena, []rng{{Segment: 0, Len: 16}})
		require.ErrorIs(t, err, backend.ErrClosed, "%s after Close", dir)
	}
	require.Equal(t, w.poolModel, w.arena.Bytes(), "arena changed by a refused copy")
}

// testCloseDuringCopies: Close racing copies in flight is safe: each copy
// either completes or reports ErrClosed, and Close returns.
func testCloseDuringCopies(t *testing.T, h Harness) {
	const workers, block = 4, 64 << 10
	w := newWorld(t, h, []int64{workers * block}, workers*block)
	var wg, started sync.WaitGroup
	errs := make(chan error, workers)
	for k := range workers {
		r := rng{Segment: 0, SegOffset: int64(k) * block, PoolOff: int64(k) * block, Len: block}
		wg.Add(1)
		started.Add(1)
		go func() {
			defer wg.Done()
			first := true
			for {
				err := w.dev.Copy(backend.DeviceToHost, w.arena, []rng{r})
				if first {
					started.Done()
					first = false
				}
				if errors.Is(err, backend.ErrClosed) {
					return
				}
				if err != nil {
					errs <- fmt.Errorf("worker %d: %w", k, err)
					return
				}
			}
		}()
	}
	waitGroup(t, &started, "every worker's first copy")
	require.NoError(t, w.dev.Close())
	waitGroup(t, &wg, "workers to see ErrClosed")
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

package backendtest

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// Harness is what a backend gives the suite.
type Harness struct {
	// New returns a fresh backend for one test.
	New func(t *testing.T) backend.Backend
	// Segments makes device segments of the given sizes (any initial
	// content) and removes them in t.Cleanup.
	Segments func(t *testing.T, sizes []int64) Segments
}

// Segments is a set of device segments as the engine sees them.
type Segments struct {
	// Specs go to Backend.Attach, in order.
	Specs []messages.Segment
	// Write puts p at byte off of segment seg, from the engine's side (for
	// cuda: a device copy), failing t on error.
	Write func(seg int, off int64, p []byte)
	// Read returns n bytes at off of segment seg, from the engine's side.
	Read func(seg int, off, n int64) []byte
}

// waitLimit bounds every wait in the suite; a backend that hangs fails the
// test with what was being waited for instead of timing out the binary.
const waitLimit = 30 * time.Second

// Run runs the conformance suite as subtests of t.
func Run(t *testing.T, h Harness) {
	t.Run("Name", func(t *testing.T) {
		require.NotEmpty(t, h.New(t).Name())
	})
	t.Run("AllocArena", func(t *testing.T) { testAllocArena(t, h) })
	t.Run("AttachNoSegments", func(t *testing.T) {
		_, err := h.New(t).Attach("e1", nil)
		require.ErrorIs(t, err, backend.ErrBadSegment)
	})
	t.Run("SegmentSize", func(t *testing.T) {
		sizes := []int64{4096, 3*4096 + 100, 1}
		w := newWorld(t, h, sizes, 4096)
		for i, size := range sizes {
			require.Equal(t, size, w.dev.SegmentSize(i), "segment %d", i)
		}
	})
	t.Run("Store", func(t *testing.T) { testStore(t, h) })
	t.Run("Load", func(t *testing.T) { testLoad(t, h) })
	t.Run("RoundTrip", func(t *testing.T) { testRoundTrip(t, h) })
	t.Run("EmptyAndZeroLength", func(t *testing.T) { testEmpty(t, h) })
	t.Run("OutOfRange", func(t *testing.T) { testOutOfRange(t, h) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, h) })
	t.Run("CloseThenCopy", func(t *testing.T) { testCloseThenCopy(t, h) })
	t.Run("CloseDuringCopies", func(t *testing.T) { testCloseDuringCopies(t, h) })
}

// world is one attached device plus an arena, and a model of what every byte
// of both should hold.
type world struct {
	t     *testing.T
	dev   backend.Attachment
	arena backend.Arena
	segs  Segments
	sizes []int64

	devModel  [][]byte
	poolModel []byte
}

// newWorld attaches segments of sizes and an arena of arenaBytes, and fills
// both with distinct random bytes so any misplaced copy shows.
func newWorld(t *testing.T, h Harness, sizes []int64, arenaBytes int64) *world {
	t.Helper()
	b := h.New(t)
	arena, err := b.AllocArena(arenaBytes)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, arena.Close()) })
	segs := h.Segments(t, sizes)
	require.Len(t, segs.Specs, len(sizes))
	dev, err := b.Attach("e1", segs.Specs)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })

	w := &world{t: t, dev: dev, arena: arena, segs: segs, sizes: sizes}
	for i, size := range sizes {
		p := pattern(uint64(i)+1, size)
		segs.Write(i, 0, p)
		w.devModel = append(w.devModel, p)
	}
	pool := arena.Bytes()
	require.GreaterOrEqual(t, int64(len(pool)), arenaBytes, "arena is smaller than asked")
	copy(pool, pattern(1000, int64(len(pool))))
	w.poolModel = bytes.Clone(pool)
	w.verify("after setup")
	return w
}

// pattern returns n reproducible pseudo-random bytes.
func pattern(seed uint64, n int64) []byte {
	var s [32]byte
	s[0], s[1] = byte(seed), byte(seed>>8)
	p := make([]byte, n)
	_, _ = rand.NewChaCha8(s).Read(p)
	return p
}

// copy runs Copy and, when it succeeds, applies the same ranges to the model.
func (w *world) copy(dir backend.Direction, ranges ...backend.Range) error {
	err := w.dev.Copy(dir, w.arena, ranges)
	if err == nil {
		w.apply(dir, ranges)
	}
	return err
}

// apply is the model of Copy: the obvious byte copy per range.
func (w *world) apply(dir backend.Direction, ranges []backend.Range) {
	for _, r := range ranges {
		dev := w.devModel[r.Segment][r.SegOffset : r.SegOffset+r.Len]
		host := w.poolModel[r.PoolOff : r.PoolOff+r.Len]
		if dir == backend.DeviceToHost {
			copy(host, dev)
		} else {
			copy(dev, host)
		}
	}
}

// verify compares every byte of every segment and of the arena with the model.
func (w *world) verify(when string) {
	w.t.Helper()
	for i, size := range w.sizes {
		sameBytes(w.t, w.devModel[i], w.segs.Read(i, 0, size), fmt.Sprintf("%s: segment %d", when, i))
	}
	sameBytes(w.t, w.poolModel, w.arena.Bytes(), when+": arena")
}

// Diff returns the offset of the first byte where want and got (of equal
// length) differ, and how many bytes differ; (-1, 0) when they are equal.
// Byte-for-byte checks report this rather than dumping megabytes.
func Diff(want, got []byte) (first, n int) {
	first = -1
	for i := range want {
		if want[i] != got[i] {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	return first, n
}

// sameBytes reports the first difference instead of dumping megabytes.
func sameBytes(t *testing.T, want, got []byte, what string) {
	t.Helper()
	if bytes.Equal(want, got) {
		return
	}
	require.Len(t, got, len(want), what)
	first, n := Diff(want, got)
	require.Failf(t, "bytes differ", "%s: %d of %d bytes differ, first at %d (want %#02x, got %#02x)",
		what, n, len(want), first, want[first], got[first])
}

// waitGroup waits for wg for at most waitLimit, saying what it waited for.
func waitGroup(t *testing.T, wg *sync.WaitGroup, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(waitLimit):
		require.FailNow(t, "timed out", "waited %v for %s", waitLimit, what)
	}
}

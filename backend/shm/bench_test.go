package shm_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// blocksPerOp is how many blocks one Copy moves, about one store job's worth.
const blocksPerOp = 16

// BenchmarkCopy measures Attachment.Copy in both directions against a plain
// copy() of the same bytes, so the backend's own overhead (bounds checks,
// locks) shows as the gap. Memory is touched once before timing so page
// faults are not measured.
func BenchmarkCopy(b *testing.B) {
	for _, size := range []int64{64 << 10, 512 << 10, 2 << 20} {
		label := fmt.Sprintf("%dKiB", size>>10)
		if size >= 1<<20 {
			label = fmt.Sprintf("%dMiB", size>>20)
		}
		dev, arena := benchSetup(b, size)
		ranges := make([]backend.Range, blocksPerOp)
		for i := range ranges {
			// Spread blocks as a pool does: device and arena slots differ.
			ranges[i] = backend.Range{
				SegOffset: int64(i) * size,
				PoolOff:   int64(blocksPerOp-1-i) * size,
				Len:       size,
			}
		}
		for _, dir := range []backend.Direction{backend.DeviceToHost, backend.HostToDevice} {
			b.Run(fmt.Sprintf("%s/%s", dir, label), func(b *testing.B) {
				b.SetBytes(blocksPerOp * size)
				for b.Loop() {
					if err := dev.Copy(dir, arena, ranges); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
		b.Run("baseline/"+label, func(b *testing.B) {
			src := make([]byte, blocksPerOp*size)
			dst := make([]byte, blocksPerOp*size)
			copy(dst, src)
			b.SetBytes(blocksPerOp * size)
			for b.Loop() {
				for _, r := range ranges {
					copy(dst[r.PoolOff:r.PoolOff+r.Len], src[r.SegOffset:r.SegOffset+r.Len])
				}
			}
		})
	}
}

func benchSetup(b *testing.B, block int64) (backend.Attachment, backend.Arena) {
	b.Helper()
	dir := b.TempDir()
	seg := create(b, dir, fmt.Sprintf("bench-%d", block), blocksPerOp*block)
	mem := seg.Bytes()
	for i := range mem {
		mem[i] = byte(i)
	}
	be := newBackend(b, dir)
	dev, err := be.Attach("bench", []messages.Segment{seg.Spec()})
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, dev.Close()) })
	arena, err := be.AllocArena(blocksPerOp * block)
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, arena.Close()) })
	clear(arena.Bytes())
	return dev, arena
}

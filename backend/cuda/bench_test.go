//go:build cuda

package cuda

import (
	"fmt"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
)

// BenchmarkD2H measures device→pinned-host bandwidth for 64 MiB per
// operation in ranges of one size: through Copy with ranges that cannot
// merge (gaps on the device), through Copy with adjacent ranges (merged into
// one DMA), and with plain synchronous cuMemcpyDtoH per range as the
// baseline. Run: go test -tags cuda -run '^$' -bench D2H ./backend/cuda/
func BenchmarkD2H(b *testing.B) {
	const total = 64 << 20
	bk := openBackend(b)
	buf, err := bk.AllocDevice(2 * total)
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, buf.Free()) })
	dev, err := bk.attachPointers([]cu.DevicePtr{buf.ptr}, []int64{2 * total})
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, dev.Close()) })
	a := allocArena(b, bk, total)
	host := a.(*arena).ptr

	for _, size := range []int64{64 << 10, 512 << 10, 2 << 20} {
		n := total / size
		gapped := make([]backend.Range, n)
		adjacent := make([]backend.Range, n)
		for i := range n {
			gapped[i] = backend.Range{SegOffset: 2 * i * size, PoolOff: i * size, Len: size}
			adjacent[i] = backend.Range{SegOffset: i * size, PoolOff: i * size, Len: size}
		}
		name := fmt.Sprintf("%dKiB", size>>10)
		b.Run("copy/"+name, func(b *testing.B) {
			b.SetBytes(total)
			for b.Loop() {
				if err := dev.Copy(backend.DeviceToHost, a, gapped); err != nil {
					b.Fatal(err)
				}
			}
			reportGBs(b, total)
		})
		b.Run("merged/"+name, func(b *testing.B) {
			b.SetBytes(total)
			for b.Loop() {
				if err := dev.Copy(backend.DeviceToHost, a, adjacent); err != nil {
					b.Fatal(err)
				}
			}
			reportGBs(b, total)
		})
		b.Run("memcpy/"+name, func(b *testing.B) {
			b.SetBytes(total)
			for b.Loop() {
				err := bk.w.do(func() error {
					for _, r := range gapped {
						p := unsafe.Add(host, r.PoolOff)
						if err := check("cuMemcpyDtoH", cu.MemcpyDtoH(p, buf.ptr+cu.DevicePtr(r.SegOffset), r.Len)); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
			}
			reportGBs(b, total)
		})
	}
}

func reportGBs(b *testing.B, perOp int64) {
	if s := b.Elapsed().Seconds(); s > 0 {
		b.ReportMetric(float64(perOp)*float64(b.N)/s/1e9, "GB/s")
	}
}

//go:build cuda

package cuda

import (
	"fmt"
	"syscall"
	"testing"
	"time"
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
// Each also reports the process's CPU time per operation (cpu-µs/op), what
// polling for the copy's end costs.
func BenchmarkD2H(b *testing.B) {
	benchDirection(b, backend.DeviceToHost, 64<<10, 512<<10, 2<<20)
}

// BenchmarkH2D is BenchmarkD2H's loads: pinned host → device, with plain
// synchronous cuMemcpyHtoD per block as the baseline.
// On a GPU: cuda.test -test.run '^$' -test.bench H2D -test.count 3
func BenchmarkH2D(b *testing.B) {
	benchDirection(b, backend.HostToDevice, 64<<10, 2<<20)
}

// benchDirection runs copy, merged and memcpy in dir for each block size;
// gpu-check reads the names ("copy/64KiB").
func benchDirection(b *testing.B, dir backend.Direction, sizes ...int64) {
	f := newD2HFixture(b)
	for _, size := range sizes {
		gapped, adjacent := f.ranges(size)
		name := fmt.Sprintf("%dKiB", size>>10)
		b.Run("copy/"+name, func(b *testing.B) { f.copy(b, dir, gapped) })
		b.Run("merged/"+name, func(b *testing.B) { f.copy(b, dir, adjacent) })
		b.Run("memcpy/"+name, func(b *testing.B) { f.memcpy(b, dir, gapped) })
	}
}

// BenchmarkCopyLatency is one block per Copy, the way a single chunk's
// store or load runs when nothing else is queued: ns/op is how long the
// caller waits for a copy whose DMA alone takes ~1.5 µs (64 KiB) or ~50 µs
// (2 MiB) at PCIe Gen5 speed, so it shows how soon the end of a copy is seen.
// On a GPU: cuda.test -test.run '^$' -test.bench CopyLatency -test.count 3
func BenchmarkCopyLatency(b *testing.B) {
	f := newD2HFixture(b)
	for _, dir := range []backend.Direction{backend.DeviceToHost, backend.HostToDevice} {
		for _, size := range []int64{64 << 10, 2 << 20} {
			one := []backend.Range{{Len: size}}
			b.Run(fmt.Sprintf("%s/%dKiB", dir, size>>10), func(b *testing.B) { f.copy(b, dir, one) })
		}
	}
}

// d2hFixture is 128 MiB on the device and a 64 MiB pinned arena (both
// directions use it).
type d2hFixture struct {
	bk    *Backend
	buf   *DeviceBuffer
	dev   *device
	arena backend.Arena
}

const d2hTotal = 64 << 20

func newD2HFixture(b *testing.B) *d2hFixture {
	bk := openBackend(b)
	buf, err := bk.AllocDevice(2 * d2hTotal)
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, buf.Free()) })
	dev, err := bk.attachPointers([]cu.DevicePtr{buf.ptr}, []int64{2 * d2hTotal})
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, dev.Close()) })
	return &d2hFixture{bk: bk, buf: buf, dev: dev, arena: allocArena(b, bk, d2hTotal)}
}

// ranges returns d2hTotal in blocks of size: gapped on the device (nothing
// merges) and adjacent (one copy).
func (f *d2hFixture) ranges(size int64) (gapped, adjacent []backend.Range) {
	n := d2hTotal / size
	gapped = make([]backend.Range, n)
	adjacent = make([]backend.Range, n)
	for i := range n {
		gapped[i] = backend.Range{SegOffset: 2 * i * size, PoolOff: i * size, Len: size}
		adjacent[i] = backend.Range{SegOffset: i * size, PoolOff: i * size, Len: size}
	}
	return gapped, adjacent
}

// copy is Copy of ranges in dir, each op their bytes.
func (f *d2hFixture) copy(b *testing.B, dir backend.Direction, ranges []backend.Range) {
	var bytes int64
	for _, r := range ranges {
		bytes += r.Len
	}
	b.SetBytes(bytes)
	cpu0 := processCPU(b)
	for b.Loop() {
		if err := f.dev.Copy(dir, f.arena, ranges); err != nil {
			b.Fatal(err)
		}
	}
	report(b, bytes, cpu0)
}

// memcpy is the baseline: plain synchronous cuMemcpyDtoH (or HtoD) per range.
func (f *d2hFixture) memcpy(b *testing.B, dir backend.Direction, ranges []backend.Range) {
	host := f.arena.(*arena).ptr
	buf, bk := f.buf, f.bk
	b.SetBytes(d2hTotal)
	cpu0 := processCPU(b)
	for b.Loop() {
		err := bk.w.do(func() error {
			for _, r := range ranges {
				p, d := unsafe.Add(host, r.PoolOff), buf.ptr+cu.DevicePtr(r.SegOffset)
				if dir == backend.HostToDevice {
					if err := check("cuMemcpyHtoD", cu.MemcpyHtoD(d, p, r.Len)); err != nil {
						return err
					}
				} else if err := check("cuMemcpyDtoH", cu.MemcpyDtoH(p, d, r.Len)); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	report(b, d2hTotal, cpu0)
}

// report adds GB/s and the process's CPU µs per operation.
func report(b *testing.B, perOp int64, cpu0 time.Duration) {
	cpu := processCPU(b) - cpu0
	if s := b.Elapsed().Seconds(); s > 0 {
		b.ReportMetric(float64(perOp)*float64(b.N)/s/1e9, "GB/s")
	}
	if b.N > 0 {
		b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
	}
}

// processCPU is the user and system time of every thread of the process.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

package store

import (
	"fmt"
	"hash/crc32"
	"testing"
)

// The cost of integrity: CRC-32C (Castagnoli, hardware-accelerated where the
// CPU has it) against a plain memory copy of the same chunk. Recorded in
// docs/BENCHMARKS.md; run with
//
//	go test -run '^$' -bench 'Checksum|MemCopy' ./store
func BenchmarkChecksum(b *testing.B) {
	for _, size := range []int{256, 8 << 10, 2 << 20} {
		buf := make([]byte, size)
		for i := range buf {
			buf[i] = byte(i)
		}
		b.Run(sizeName(size), func(b *testing.B) {
			b.SetBytes(int64(size))
			var sum uint32
			for b.Loop() {
				sum = crc32.Update(0, castagnoli, buf)
			}
			_ = sum
		})
	}
}

func BenchmarkMemCopy(b *testing.B) {
	for _, size := range []int{256, 8 << 10, 2 << 20} {
		src, dst := make([]byte, size), make([]byte, size)
		b.Run(sizeName(size), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				copy(dst, src)
			}
		})
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

package disk

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvactors/kvactors/messages"
)

// Disk tier throughput against a plain sequential write or read of the same
// bytes into one file, in the same run (docs/BENCHMARKS.md; goal >= 0.8x):
//
//	go test -run '^$' -bench 'DiskWrite|PlainWrite|DiskRead|PlainRead' -benchtime 64x ./disk
//
// Each op is one 2 MiB chunk (or 8 KiB with the /8KiB variants). Writes go
// to the page cache (no fsync, as the tier relies on; see doc.go).
func BenchmarkDiskWrite(b *testing.B) {
	for _, size := range []int{8 << 10, 2 << 20} {
		b.Run(name(size), func(b *testing.B) {
			data := payload(size)
			d, err := Open(Config{Dir: b.TempDir(), Bytes: 1 << 40, QueueBytes: 1 << 40}, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				d.Spill("e", benchKey(i), sum(data), data)
			}
			d.Close() // waits for the writer: every chunk is on disk
		})
	}
}

func BenchmarkPlainWrite(b *testing.B) {
	for _, size := range []int{8 << 10, 2 << 20} {
		b.Run(name(size), func(b *testing.B) {
			data := payload(size)
			f, err := os.Create(filepath.Join(b.TempDir(), "plain"))
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := f.Write(data); err != nil {
					b.Fatal(err)
				}
			}
			if err := f.Close(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

func BenchmarkDiskRead(b *testing.B) {
	for _, size := range []int{8 << 10, 2 << 20} {
		b.Run(name(size), func(b *testing.B) {
			data := payload(size)
			d, err := Open(Config{Dir: b.TempDir(), Bytes: 1 << 40, QueueBytes: 1 << 40}, nil)
			if err != nil {
				b.Fatal(err)
			}
			for i := 0; i < b.N; i++ {
				d.Spill("e", benchKey(i), sum(data), data)
			}
			d.Close()
			d, err = Open(Config{Dir: d.cfg.Dir, Bytes: 1 << 40}, nil) // reopened: rebuilt index
			if err != nil {
				b.Fatal(err)
			}
			dst := make([]byte, size)
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := d.readInto("e", benchKey(i), [][]byte{dst}); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			d.Close()
		})
	}
}

func BenchmarkPlainRead(b *testing.B) {
	for _, size := range []int{8 << 10, 2 << 20} {
		b.Run(name(size), func(b *testing.B) {
			data := payload(size)
			path := filepath.Join(b.TempDir(), "plain")
			f, err := os.Create(path)
			if err != nil {
				b.Fatal(err)
			}
			for i := 0; i < b.N; i++ {
				if _, err := f.Write(data); err != nil {
					b.Fatal(err)
				}
			}
			_ = f.Close()
			f, err = os.Open(path)
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			dst := make([]byte, size)
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := f.Read(dst); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func payload(size int) []byte {
	b := make([]byte, size)
	for i := range b {
		b[i] = byte(i*31 + i>>9)
	}
	return b
}

func benchKey(i int) messages.Key { return messages.Key(fmt.Sprintf("bench-%08d", i)) }

func name(size int) string {
	if size >= 1<<20 {
		return fmt.Sprintf("%dMiB", size>>20)
	}
	return fmt.Sprintf("%dKiB", size>>10)
}

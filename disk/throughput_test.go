package disk

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestThroughputVsPlain measures the disk tier's write and read rates
// against a plain sequential write and read of the same bytes into one file,
// interleaved round by round in one run so both see the same machine (medians
// of 5 rounds). Writes land in the page cache (no fsync, as the tier relies
// on). Recorded in docs/BENCHMARKS.md; opt-in, it moves ~1.3 GB:
//
//	KVACTORS_DISK_THROUGHPUT=1 go test -run TestThroughputVsPlain -v ./disk
func TestThroughputVsPlain(t *testing.T) {
	if os.Getenv("KVACTORS_DISK_THROUGHPUT") == "" {
		t.Skip("set KVACTORS_DISK_THROUGHPUT=1")
	}
	for _, c := range []struct {
		size, n int
	}{{8 << 10, 8192}, {2 << 20, 32}} {
		data := payload(c.size)
		total := float64(c.size * c.n)
		var dw, pw, dr, pr []float64 // GB/s per round
		for round := range 5 {
			dir := t.TempDir()
			plain := filepath.Join(dir, "plain")
			writeDisk := func() {
				d, err := Open(Config{Dir: dir, Bytes: 1 << 40, QueueBytes: 1 << 40}, nil)
				require.NoError(t, err)
				start := time.Now()
				for i := 0; i < c.n; i++ {
					require.True(t, d.Spill("e", benchKey(i), sum(data), data))
				}
				d.Close() // the writer drained: every chunk is in its segment
				dw = append(dw, total/time.Since(start).Seconds()/1e9)
			}
			writePlain := func() {
				start := time.Now()
				f, err := os.Create(plain)
				require.NoError(t, err)
				for i := 0; i < c.n; i++ {
					_, err := f.Write(data)
					require.NoError(t, err)
				}
				require.NoError(t, f.Close())
				pw = append(pw, total/time.Since(start).Seconds()/1e9)
			}
			if round%2 == 0 { // alternate who writes into a page cache the other dirtied
				writeDisk()
				writePlain()
			} else {
				writePlain()
				writeDisk()
			}

			d, err := Open(Config{Dir: dir, Bytes: 1 << 40}, nil)
			require.NoError(t, err)
			dst := make([]byte, c.size)
			start := time.Now()
			for i := 0; i < c.n; i++ {
				_, err := d.ReadInto("e", benchKey(i), [][]byte{dst})
				require.NoError(t, err)
			}
			dr = append(dr, total/time.Since(start).Seconds()/1e9)
			d.Close()

			start = time.Now()
			f, err := os.Open(plain)
			require.NoError(t, err)
			for i := 0; i < c.n; i++ {
				_, err := f.Read(dst)
				require.NoError(t, err)
			}
			require.NoError(t, f.Close())
			pr = append(pr, total/time.Since(start).Seconds()/1e9)
		}
		med := func(x []float64) float64 { slices.Sort(x); return x[len(x)/2] }
		mdw, mpw, mdr, mpr := med(dw), med(pw), med(dr), med(pr)
		t.Logf("%s chunks x %d: write disk %.2f GB/s, plain %.2f GB/s (%.2fx); read disk %.2f GB/s, plain %.2f GB/s (%.2fx)",
			name(c.size), c.n, mdw, mpw, mdw/mpw, mdr, mpr, mdr/mpr)
	}
}

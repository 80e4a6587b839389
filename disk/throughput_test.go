package disk

import (
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// TestThroughputVsPlain measures the disk tier's write and read rates
// against a plain sequential write and read of the same bytes into one file
// (one write or read call per chunk), interleaved in one run so both see the
// same machine: each round does both writes, then both reads, the order of
// each pair alternating from round to round. It reports per-round ratios
// (median and range over 7 rounds). Reads are measured a chunk per call
// (readInto) and, for chunks smaller than groupBytes, a load of 32 adjacent
// chunks per call (ReadMany: one preadv per 512 KiB); the plain read is one read
// call per chunk in both. Writes land in the page cache (no fsync,
// as the tier relies on). For the floor of a verified read it also measures,
// in the same run, CRC-32C over a cache-hot tile and copy() between two
// buffers of the chunk's size. Recorded in docs/BENCHMARKS.md; opt-in, it
// moves ~2 GB:
//
//	KVACTORS_DISK_THROUGHPUT=1 go test -count=1 -run TestThroughputVsPlain -v ./disk
func TestThroughputVsPlain(t *testing.T) {
	if os.Getenv("KVACTORS_DISK_THROUGHPUT") == "" {
		t.Skip("set KVACTORS_DISK_THROUGHPUT=1")
	}
	const rounds = 7
	for _, c := range []struct {
		size, n int
	}{{8 << 10, 8192}, {2 << 20, 32}} {
		data := payload(c.size)
		total := float64(c.size * c.n)
		rate := func(f func()) float64 { start := time.Now(); f(); return total / time.Since(start).Seconds() / 1e9 }
		var w, r, l rates              // writes, reads a chunk per call, reads a load per call
		grouped := c.size < groupBytes // larger records are read alone: a load is then chunks per call
		keys, dsts, sums := make([]messages.Key, loadChunks), make([][][]byte, loadChunks), make([]uint32, loadChunks)
		for j := range dsts { // a load's host room, touched before any round as an arena's would be
			if grouped {
				dsts[j] = [][]byte{slices.Clone(data)}
			}
		}
		for round := range rounds {
			dir := t.TempDir()
			plain := filepath.Join(dir, "plain")
			writeDisk := func() {
				d, err := Open(Config{Dir: dir, Bytes: 1 << 40, QueueBytes: 1 << 40}, nil)
				require.NoError(t, err)
				w.disk = append(w.disk, rate(func() {
					for i := 0; i < c.n; i++ {
						require.True(t, d.Spill("e", benchKey(i), sum(data), data))
					}
					d.Close() // the writer drained: every chunk is in its segment
				}))
			}
			writePlain := func() {
				w.plain = append(w.plain, rate(func() {
					f, err := os.Create(plain)
					require.NoError(t, err)
					for i := 0; i < c.n; i++ {
						_, err := f.Write(data)
						require.NoError(t, err)
					}
					require.NoError(t, f.Close())
				}))
			}
			var d *Disk
			dst := make([]byte, c.size)
			readDisk := func() {
				r.disk = append(r.disk, rate(func() {
					for i := 0; i < c.n; i++ {
						_, err := d.readInto("e", benchKey(i), [][]byte{dst})
						require.NoError(t, err)
					}
				}))
			}
			readLoads := func() {
				l.disk = append(l.disk, rate(func() {
					for i := 0; i < c.n; i += loadChunks {
						for j := range keys {
							keys[j] = benchKey(i + j)
						}
						_, err := d.ReadMany("e", keys, dsts, sums)
						require.NoError(t, err)
					}
				}))
			}
			readPlain := func() {
				r.plain = append(r.plain, rate(func() {
					f, err := os.Open(plain)
					require.NoError(t, err)
					for i := 0; i < c.n; i++ {
						_, err := f.Read(dst)
						require.NoError(t, err)
					}
					require.NoError(t, f.Close())
				}))
			}
			if round%2 == 0 { // alternate who goes first
				writeDisk()
				writePlain()
			} else {
				writePlain()
				writeDisk()
			}
			d, err := Open(Config{Dir: dir, Bytes: 1 << 40}, nil) // the rebuilt index
			require.NoError(t, err)
			if round%2 == 0 {
				readPlain()
				readDisk()
				if grouped {
					readLoads()
				}
			} else {
				if grouped {
					readLoads()
				}
				readDisk()
				readPlain()
			}
			l.plain = r.plain
			d.Close()
			r.crc = append(r.crc, rate(func() {
				tile := data[:min(len(data), groupBytes)]
				for n := 0; n < c.size*c.n; n += len(tile) {
					crc32.Checksum(tile, castagnoli)
				}
			}))
			r.copy = append(r.copy, rate(func() {
				for i := 0; i < c.n; i++ {
					copy(dst, data)
				}
			}))
		}
		t.Logf("%s chunks x %d: write %s", name(c.size), c.n, w)
		t.Logf("%s chunks x %d: read, a chunk per call: %s", name(c.size), c.n, r)
		if len(l.disk) > 0 {
			t.Logf("%s chunks x %d: read, a load of %d adjacent chunks per call: %s", name(c.size), c.n, loadChunks, l)
		}
		plain, crc := med(r.plain), med(r.crc)
		t.Logf("%s chunks x %d: CRC-32C (cache-hot tile) %.1f GB/s, copy() %.1f GB/s; a read then a CRC in series: "+
			"1/(1/%.1f + 1/%.1f) = %.1f GB/s = %.2fx of plain",
			name(c.size), c.n, crc, med(r.copy), plain, crc, 1/(1/plain+1/crc), crc/(plain+crc))
	}
}

// loadChunks is the chunks of one load in the read-a-load-per-call rows.
const loadChunks = 32

// rates are per-round GB/s of the disk tier and of the plain file.
type rates struct {
	disk, plain, crc, copy []float64
}

func (r rates) String() string {
	ratios := make([]float64, len(r.disk))
	for i := range ratios {
		ratios[i] = r.disk[i] / r.plain[i]
	}
	slices.Sort(ratios)
	return fmt.Sprintf("disk %.2f GB/s, plain %.2f GB/s (medians); disk/plain per round: median %.2fx, range %.2f-%.2fx",
		med(r.disk), med(r.plain), med(ratios), ratios[0], ratios[len(ratios)-1])
}

func med(x []float64) float64 {
	x = slices.Clone(x)
	slices.Sort(x)
	return x[len(x)/2]
}

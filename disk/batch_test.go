package disk

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// writeBatch appends spills as one batch, as the writer does with what it
// finds queued (called here directly so the batch is known; the writer
// goroutine has nothing queued meanwhile).
func writeBatch(d *Disk, engine string, chunks map[int][]byte, order ...int) {
	w := &writer{d: d}
	for _, i := range order {
		w.batch = append(w.batch, spill{engine, key(i), sum(chunks[i]), chunks[i]})
	}
	w.write()
}

// batchChunks are small and large records (a large one's data is written
// from the spill's own bytes, after the buffer ending in its header).
func batchChunks() map[int][]byte {
	m := map[int][]byte{}
	for i, size := range []int{8 << 10, 300, 200 << 10, 8 << 10, 1, 64 << 10, 70 << 10, 8 << 10} {
		m[i] = bytes.Repeat([]byte{byte('a' + i)}, size)
	}
	return m
}

// A batch torn in the middle (the file cut inside one of its records, as a
// crash mid-write or a lost tail leaves it): the records before the tear
// survive the rebuild and read back byte for byte; the torn one and every
// one after it in the batch are discarded, never served; the cut stays cut.
func TestBatchTornInTheMiddle(t *testing.T) {
	for _, torn := range []int{1, 2, 3, 6} { // small, large, small after a large, large after smalls
		t.Run(fmt.Sprint(torn), func(t *testing.T) {
			dir := t.TempDir()
			ev := &events{}
			d, err := Open(Config{Dir: dir, Bytes: 64 << 20}, ev.notify)
			require.NoError(t, err)
			chunks := batchChunks()
			writeBatch(d, "e", chunks, 0, 1, 2, 3, 4, 5, 6, 7)
			stored, _ := ev.get()
			require.Equal(t, []messages.Key{key(0), key(1), key(2), key(3), key(4), key(5), key(6), key(7)}, stored,
				"announced stored once written, in write order")
			path, off, ok := d.Where(key(torn))
			require.True(t, ok)
			d.Close()
			require.NoError(t, os.Truncate(path, off+int64(len(chunks[torn]))/2))

			d2, err := Open(Config{Dir: dir, Bytes: 64 << 20}, nil)
			require.NoError(t, err)
			t.Cleanup(d2.Close)
			var want []messages.Key
			for i := range torn {
				want = append(want, key(i))
			}
			require.Equal(t, want, d2.Keys())
			require.Equal(t, int64(1), d2.Stats().Discarded)
			for i := range torn {
				got, err := readBack(t, d2, key(i), len(chunks[i]))
				require.NoError(t, err)
				require.Equal(t, chunks[i], got)
			}
			for i := torn; i < len(chunks); i++ {
				_, err := readBack(t, d2, key(i), len(chunks[i]))
				require.ErrorIs(t, err, ErrMissing, "chunk %d is not served", i)
			}
			d2.Close()
			d3, err := Open(Config{Dir: dir, Bytes: 64 << 20}, nil)
			require.NoError(t, err)
			t.Cleanup(d3.Close)
			require.Zero(t, d3.Stats().Discarded, "a second open finds nothing torn")
			require.Equal(t, want, d3.Keys())
		})
	}
}

// A batch whose records do not fit the current segment goes on in a new
// one; a raced record in it is left out and the rest written; a key written
// twice in one batch keeps its later bytes; the budget is kept after every
// record (the least recently used go first) and all of it comes back after a
// rebuild.
func TestBatchAcrossSegmentsRacedAndBudget(t *testing.T) {
	dir := t.TempDir()
	ev := &events{}
	d, err := Open(Config{Dir: dir, Bytes: 400 << 10, SegmentBytes: 100 << 10}, ev.notify)
	require.NoError(t, err)
	chunks := batchChunks()
	w := &writer{d: d}
	for _, i := range []int{0, 1, 2, 3, 4, 5, 6, 7} {
		s := sum(chunks[i])
		if i == 4 {
			s ^= 1 // raced: the host bytes changed after their sum was taken
		}
		w.batch = append(w.batch, spill{"e", key(i), s, chunks[i]})
	}
	later := bytes.Repeat([]byte("z"), 8<<10)
	w.batch = append(w.batch, spill{"e", key(3), sum(later), later})
	w.write()
	chunks[3] = later
	require.Equal(t, int64(1), d.Stats().Raced)
	// 0 (8K), 1 (300), 2 (200K), 5 (64K), 6 (70K), 7 (8K), 3 again (8K): ~358 KiB, within the budget
	want := []messages.Key{key(0), key(1), key(2), key(5), key(6), key(7), key(3)}
	require.Equal(t, want, d.Keys())
	segs, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Greater(t, len(segs), 2, "the batch went on in new segments")
	for _, k := range want {
		var i int
		_, err := fmt.Sscanf(string(k), "chunk-%d", &i)
		require.NoError(t, err)
		got, err := readBack(t, d, k, len(chunks[i]))
		require.NoError(t, err)
		require.Equal(t, chunks[i], got)
	}
	d.Close()
	d2, err := Open(Config{Dir: dir, Bytes: 400 << 10}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, want, d2.Keys())
	require.Zero(t, d2.Stats().Discarded)

	small, err := Open(Config{Dir: t.TempDir(), Bytes: 20 << 10}, ev.notify) // the budget within a batch
	require.NoError(t, err)
	t.Cleanup(small.Close)
	writeBatch(small, "e", batchChunks(), 0, 1, 3, 7)
	require.Equal(t, []messages.Key{key(1), key(3), key(7)}, small.Keys(), "8K+300+8K+8K > 20K: the oldest went")
}

// ReadMany reads a load's keys straight into their extents, records lying
// back to back in one preadv, and checks each: a record corrupted in the
// middle of such a group fails the load naming it (its index and key), is
// dropped, and the keys before it were read and checked.
func TestReadManyGroupsAndCorruption(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 64 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	chunks := batchChunks()
	writeBatch(d, "e", chunks, 0, 1, 2, 3, 4, 5, 6, 7)
	order := []int{0, 1, 3, 4, 5, 2, 7, 6} // adjacent runs, a large one alone, out of write order
	load := func(order []int) ([][][]byte, []uint32, int, error) {
		keys := make([]messages.Key, len(order))
		dst := make([][][]byte, len(order))
		for j, i := range order {
			keys[j] = key(i)
			b := make([]byte, len(chunks[i]))
			dst[j] = [][]byte{b[:len(b)/3], b[len(b)/3 : len(b)/2], b[len(b)/2:]} // a chunk in pieces
		}
		sums := make([]uint32, len(order))
		n, err := d.ReadMany("e", keys, dst, sums)
		return dst, sums, n, err
	}
	dst, sums, n, err := load(order)
	require.NoError(t, err)
	require.Equal(t, len(order), n)
	for j, i := range order {
		require.Equal(t, chunks[i], bytes.Join(dst[j], nil), "chunk %d", i)
		require.Equal(t, sum(chunks[i]), sums[j])
	}
	require.Equal(t, int64(len(order)), d.Stats().Hits)

	flipAt(t, d, key(4), 0) // inside the run 3, 4, 5
	_, _, n, err = load([]int{3, 4, 5})
	require.ErrorIs(t, err, ErrCorrupt)
	require.Contains(t, err.Error(), fmt.Sprintf("%x", string(key(4))))
	require.Equal(t, 1, n)
	_, _, ok := d.Has(key(4))
	require.False(t, ok, "dropped")
	_, _, n, err = load([]int{3, 4, 5})
	require.ErrorIs(t, err, ErrMissing)
	require.Equal(t, 1, n)
	dst, _, _, err = load([]int{3, 5})
	require.NoError(t, err)
	require.Equal(t, chunks[5], bytes.Join(dst[1], nil))
}

// A batch of small records rolls segments on what the records take with
// their headers: no segment grows past SegmentBytes (it did by a header per
// record when only data was counted).
func TestBatchSegmentsStayWithinSegmentBytes(t *testing.T) {
	dir := t.TempDir()
	const segBytes = 16 << 10
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: segBytes}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	w := &writer{d: d}
	c := bytes.Repeat([]byte("s"), 1<<10)
	for i := range 64 {
		w.batch = append(w.batch, spill{"e", key(i), sum(c), c})
	}
	w.write()
	require.Len(t, d.Keys(), 64)
	files, err := filepath.Glob(filepath.Join(dir, "*"+segSuffix))
	require.NoError(t, err)
	require.Greater(t, len(files), 3)
	for _, f := range files {
		fi, err := os.Stat(f)
		require.NoError(t, err)
		require.LessOrEqual(t, fi.Size(), int64(segBytes), f)
	}
}

// A write that fails indexes and announces none of its records, counts
// them failed, and leaves the segment as it was: nothing is lost silently
// (the chunks were evicted from host memory already; they are counted) and
// nothing half-written is ever served; the segment stays usable
// (later batches are written once the segment takes writes again).
func TestFailedWriteIndexesAndAnnouncesNothing(t *testing.T) {
	dir := t.TempDir()
	ev := &events{}
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	w := &writer{d: d}
	good := bytes.Repeat([]byte("g"), 512)
	w.batch = append(w.batch, spill{"e", key(0), sum(good), good})
	w.write()
	require.Equal(t, []messages.Key{key(0)}, d.Keys())

	d.mu.Lock()
	seg := d.segs[len(d.segs)-1]
	writable := seg.f
	ro, err := os.Open(writable.Name()) // writes to it fail
	require.NoError(t, err)
	seg.f = ro
	size := seg.size
	d.mu.Unlock()
	w.batch = w.batch[:0]
	for i := 1; i <= 3; i++ {
		c := bytes.Repeat([]byte{byte('a' + i)}, 100<<10) // one small record, two large ones
		if i == 1 {
			c = c[:300]
		}
		w.batch = append(w.batch, spill{"e", key(i), sum(c), c})
	}
	w.write()
	require.Equal(t, int64(3), d.Stats().Failed)
	require.Equal(t, []messages.Key{key(0)}, d.Keys(), "no record of the failed write is indexed")
	stored, _ := ev.get()
	require.Equal(t, []messages.Key{key(0)}, stored, "none is announced stored")
	fi, err := os.Stat(writable.Name())
	require.NoError(t, err)
	require.Equal(t, size, fi.Size(), "the segment is as it was")
	got, err := readBack(t, d, key(0), len(good))
	require.NoError(t, err)
	require.Equal(t, good, got, "the record before it still reads")

	d.mu.Lock()
	seg.f = writable
	d.mu.Unlock()
	require.NoError(t, ro.Close())
	w.batch = append(w.batch[:0], spill{"e", key(4), sum(good), good})
	w.write()
	require.Equal(t, []messages.Key{key(0), key(4)}, d.Keys(), "the segment takes writes again")
}

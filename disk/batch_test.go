package disk

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
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

// Notify hears a batch's index changes in the order they were made, so the
// last told of each key is where it is: a key in the batch twice (spilled
// again before its first record was indexed) whose first record the budget
// evicts before the second is indexed ends told stored, not removed, and a
// key evicted for good ends told removed.
func TestBatchWithARepeatedKeyEndsToldAsTheIndexHasIt(t *testing.T) {
	var mu sync.Mutex
	last := map[messages.Key]string{} // each key's last announcement, replayed as a router does
	notify := func(_ string, stored, removed []messages.Key) {
		mu.Lock()
		defer mu.Unlock()
		for _, k := range stored {
			last[k] = "stored"
		}
		for _, k := range removed {
			last[k] = "removed"
		}
	}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 250}, notify) // two 100-byte chunks
	require.NoError(t, err)
	t.Cleanup(d.Close)
	chunks := map[int][]byte{}
	for i := 1; i <= 3; i++ {
		chunks[i] = bytes.Repeat([]byte{byte(i)}, 100)
	}
	writeBatch(d, "e", chunks, 1, 2, 3, 1) // 3 evicts 1's first record, 1 again evicts 2
	require.Equal(t, []messages.Key{key(3), key(1)}, d.Keys())
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i <= 3; i++ {
		want := "removed"
		if _, _, ok := d.Has(key(i)); ok {
			want = "stored"
		}
		require.Equal(t, want, last[key(i)], "chunk %d", i)
	}
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

// failingFile is a segment file with one transient fault: a write fails
// once limit bytes have gone through (the bytes before the limit land: a
// write failing part-way), later writes go through again; its Truncate
// fails when cutFails.
type failingFile struct {
	f        *os.File
	limit    int
	cutFails bool
	failed   bool // the failing write happened
}

var errInjected = errors.New("injected fault")

func (ff *failingFile) Write(b []byte) (int, error) {
	if ff.failed {
		return ff.f.Write(b)
	}
	n, err := ff.f.Write(b[:min(len(b), ff.limit)])
	ff.limit -= n
	if err == nil && n < len(b) {
		ff.failed = true
		err = fmt.Errorf("%w: write stopped after %d of %d bytes", errInjected, n, len(b))
	}
	return n, err
}

func (ff *failingFile) Truncate(size int64) error {
	if ff.cutFails {
		return fmt.Errorf("%w: truncate", errInjected)
	}
	return ff.f.Truncate(size)
}

// failWrites makes the current segment's next write fail after limit bytes
// (and its cuts, when cutFails) and returns the segment; the writer
// goroutine has nothing queued meanwhile.
func failWrites(d *Disk, limit int, cutFails bool) *segment {
	d.mu.Lock()
	defer d.mu.Unlock()
	seg := d.segs[len(d.segs)-1]
	seg.out = &failingFile{f: seg.f, limit: limit, cutFails: cutFails}
	return seg
}

// checkRecords reads every key back byte for byte and checks the header
// just before each indexed offset names that key and size: no record is
// indexed where it does not lie.
func checkRecords(t *testing.T, d *Disk, chunks map[int][]byte, want ...int) {
	t.Helper()
	var keys []messages.Key
	for _, i := range want {
		keys = append(keys, key(i))
		path, off, ok := d.Where(key(i))
		require.True(t, ok, "chunk %d indexed", i)
		f, err := os.Open(path)
		require.NoError(t, err)
		h, err := readHeader(io.NewSectionReader(f, off-headerLen(key(i)), headerLen(key(i))))
		require.NoError(t, f.Close())
		require.NoError(t, err, "chunk %d: a record header at its offset", i)
		require.Equal(t, string(key(i)), h.key)
		require.Equal(t, int64(len(chunks[i])), h.size)
		got, err := readBack(t, d, key(i), len(chunks[i]))
		require.NoError(t, err, "chunk %d", i)
		require.Equal(t, chunks[i], got, "chunk %d", i)
	}
	require.Equal(t, keys, d.Keys())
}

// A write that fails part-way indexes and announces none of its records,
// counts them failed, and cuts the segment back to where it was: nothing is
// lost silently (the chunks were evicted from host memory already; they are
// counted) and nothing half-written is ever served; the segment stays in
// use, later batches land in it where their offsets say.
func TestFailedWriteIndexesAndAnnouncesNothing(t *testing.T) {
	dir := t.TempDir()
	ev := &events{}
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	chunks := batchChunks()
	writeBatch(d, "e", chunks, 0)
	path, _, _ := d.Where(key(0))

	// 1 (300 B) is gathered with 2's header; 2's data (200 KiB) stops after
	// 64 KiB of the batch have landed.
	seg := failWrites(d, 64<<10, false)
	size := seg.size
	writeBatch(d, "e", chunks, 1, 2, 3)
	require.True(t, seg.out.(*failingFile).failed)
	require.Zero(t, seg.out.(*failingFile).limit, "64 KiB landed before the write failed")
	require.Equal(t, int64(3), d.Stats().Failed)
	require.Zero(t, d.Stats().Retired)
	require.Equal(t, []messages.Key{key(0)}, d.Keys(), "no record of the failed write is indexed")
	stored, _ := ev.get()
	require.Equal(t, []messages.Key{key(0)}, stored, "none is announced stored")
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, size, fi.Size(), "the segment is cut back to where it was")

	writeBatch(d, "e", chunks, 4, 5, 1) // the fault has passed
	checkRecords(t, d, chunks, 0, 4, 5, 1)
	for _, i := range []int{4, 5, 1} {
		p, _, _ := d.Where(key(i))
		require.Equal(t, path, p, "chunk %d: the segment takes writes again", i)
	}
}

// A write that fails part-way and whose cut fails too leaves its bytes past
// the segment's last record, where the next append would land instead of
// where its offsets say: the segment is retired (counted) and later batches
// go to a new one, every record indexed where it lies and read back byte
// for byte; after a restart the retired segment's torn tail is cut and
// everything announced stored still reads back.
func TestFailedCutRetiresSegment(t *testing.T) {
	dir := t.TempDir()
	ev := &events{}
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	chunks := batchChunks()
	writeBatch(d, "e", chunks, 0, 1)
	path, _, _ := d.Where(key(0))

	seg := failWrites(d, 100, true) // 100 bytes of the batch land: part of 2's header
	size := seg.size
	writeBatch(d, "e", chunks, 2, 3, 4)
	st := d.Stats()
	require.Equal(t, int64(3), st.Failed)
	require.Equal(t, int64(1), st.Retired)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, size+100, fi.Size(), "the failed write's bytes stay past the last record")

	writeBatch(d, "e", chunks, 5, 6, 7, 2) // the fault has passed
	want := []int{0, 1, 5, 6, 7, 2}
	checkRecords(t, d, chunks, want...)
	for _, i := range []int{5, 6, 7, 2} {
		p, _, _ := d.Where(key(i))
		require.NotEqual(t, path, p, "chunk %d: written to a new segment", i)
	}
	stored, _ := ev.get()
	require.Equal(t, []messages.Key{key(0), key(1), key(5), key(6), key(7), key(2)}, stored)
	d.Close()

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, int64(1), d2.Stats().Discarded, "the torn tail is cut")
	checkRecords(t, d2, chunks, want...)
}

// Writes after a restart: a rebuilt segment is never written again (Open
// starts a new one), so records written after the restart, a dropped key
// written again among them, land in a new segment at the offsets they are indexed
// at, the old records are untouched, and all read back byte for byte, then
// and after a second restart.
func TestWritesAfterRestart(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1 << 20}, nil)
	require.NoError(t, err)
	chunks := batchChunks()
	for i := range 4 {
		require.True(t, d.Spill("e", key(i), sum(chunks[i]), chunks[i]))
	}
	waitOnDisk(t, d, key(0), key(1), key(2), key(3))
	path, _, _ := d.Where(key(0))
	d.Close()
	before, err := os.ReadFile(path)
	require.NoError(t, err)

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1 << 20}, nil)
	require.NoError(t, err)
	d2.Drop("e", key(1))                        // dropped, then spilled again with other bytes:
	chunks[1] = bytes.Repeat([]byte("L"), 3000) // its old record stays in the old segment
	for _, i := range []int{4, 5, 6, 7, 1} {
		require.True(t, d2.Spill("e", key(i), sum(chunks[i]), chunks[i]))
	}
	waitOnDisk(t, d2, key(4), key(5), key(6), key(7), key(1))
	want := []int{0, 2, 3, 4, 5, 6, 7, 1}
	checkRecords(t, d2, chunks, want...)
	for _, i := range []int{4, 5, 6, 7, 1} {
		p, _, _ := d2.Where(key(i))
		require.NotEqual(t, path, p, "chunk %d: written to a new segment", i)
	}
	after, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, before, after, "the rebuilt segment is untouched")
	d2.Close()

	d3, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d3.Close)
	require.Zero(t, d3.Stats().Discarded)
	checkRecords(t, d3, chunks, want...)
}

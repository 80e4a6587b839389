package disk

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// waitTombstones waits until the segments hold want bytes of tombstones
// (the writer wrote those of the records dropped so far).
func waitTombstones(t *testing.T, d *Disk, want int64) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.markBytes != want {
			return fmt.Errorf("%d bytes of tombstones written, want %d", d.markBytes, want)
		}
		return nil
	})
}

// copySegments copies d's segment files to a new directory, as a kill -9
// leaves them: what a restart finds without a Close.
func copySegments(t *testing.T, d *Disk) string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(d.cfg.Dir, "*"+segSuffix))
	require.NoError(t, err)
	dir := t.TempDir()
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o600))
	}
	return dir
}

// A record dropped at run time stays dropped across a restart, a kill -9
// included, though its bytes stay in its segment: one evicted past the
// budget (announced removed), one dropped by Drop, and one the rebuild
// trimmed to a smaller budget. So the chunks live before the restart, one
// read back early among them, are the ones after it, not crowded out of the
// budget by evicted ones brought back.
func TestADroppedRecordStaysDroppedAcrossARestart(t *testing.T) {
	ev := &events{}
	// Two 100-byte chunks, and in the files room for a third record
	// dropped: 1.5 × 290 holds three with their headers, so chunk 1 stays
	// live in the oldest segment (at 250 it would go with the segment).
	const budget = 290
	d, err := Open(Config{Dir: t.TempDir(), Bytes: budget}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	data := func(i int) []byte { return bytes.Repeat([]byte{byte(i)}, 100) }
	spillOne := func(i int) {
		require.True(t, d.Spill("e", key(i), sum(data(i)), data(i)))
		waitOnDisk(t, d, key(i))
	}
	tomb := fixedHeader + int64(len(key(0))) + 4
	spillOne(1)
	spillOne(2)
	_, err = readBack(t, d, key(1), 100) // chunk 1 is now the most recently used
	require.NoError(t, err)
	spillOne(3) // the budget evicts chunk 2
	_, removed := ev.get()
	require.Equal(t, []messages.Key{key(2)}, removed)
	waitTombstones(t, d, tomb)

	crashed := copySegments(t, d)
	d2, err := Open(Config{Dir: crashed, Bytes: budget}, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{key(1), key(3)}, d2.Keys(), "the evicted chunk stays out; the live ones stay")
	d2.Close()

	d.Drop("e", key(3))
	waitTombstones(t, d, 2*tomb)
	crashed = copySegments(t, d)
	d3, err := Open(Config{Dir: crashed, Bytes: budget}, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{key(1)}, d3.Keys(), "the dropped chunk stays out")
	d3.Close()

	d.Close()

	// Trimmed at open: room for one of chunks 1 and 2, so 1, written first,
	// goes; it stays out when the budget grows again.
	dir := t.TempDir()
	d4, err := Open(Config{Dir: dir, Bytes: 250}, nil)
	require.NoError(t, err)
	for _, i := range []int{1, 2} {
		require.True(t, d4.Spill("e", key(i), sum(data(i)), data(i)))
	}
	waitOnDisk(t, d4, key(1), key(2))
	d4.Close()
	d5, err := Open(Config{Dir: dir, Bytes: 150}, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{key(2)}, d5.Keys())
	d5.Close()
	d6, err := Open(Config{Dir: dir, Bytes: 250}, nil)
	require.NoError(t, err)
	t.Cleanup(d6.Close)
	require.Equal(t, []messages.Key{key(2)}, d6.Keys(), "the chunk trimmed at the last open stays out")
	require.Zero(t, d6.Stats().Discarded)
}

// A tombstone names a record, not a key: a key spilled twice in one batch
// whose first record the budget evicted keeps its second record across a
// restart, and its tombstone drops only the first.
func TestATombstoneDropsItsRecordNotALaterOneOfTheKey(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 250}, nil) // two 100-byte chunks
	require.NoError(t, err)
	chunks := map[int][]byte{}
	for i := 1; i <= 3; i++ {
		chunks[i] = bytes.Repeat([]byte{byte(i)}, 100)
	}
	writeBatch(d, "e", chunks, 1, 2, 3, 1) // 3 evicts 1's first record, 1 again evicts 2
	require.Equal(t, []messages.Key{key(3), key(1)}, d.Keys())
	d.Close() // writes the tombstones of 1's first record and of 2

	d2, err := Open(Config{Dir: dir, Bytes: 250}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, []messages.Key{key(3), key(1)}, d2.Keys())
	checkRecords(t, d2, chunks, 3, 1)
}

// wroteFile is a segment file that reports each write's error on wrote, so
// a test can tell when the writer goroutine has tried one.
type wroteFile struct {
	appendFile
	wrote chan error
}

func (w *wroteFile) Write(b []byte) (int, error) {
	n, err := w.appendFile.Write(b)
	w.wrote <- err
	return n, err
}

// A tombstone write that fails part-way is cut back (or, when the cut fails
// too, its segment retired) and its tombstones stay queued: the writer's
// next wake writes them, and a restart then leaves the dropped records out.
func TestAFailedTombstoneWriteIsWrittenOnTheNextWake(t *testing.T) {
	for _, cutFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("cutFails=%v", cutFails), func(t *testing.T) {
			d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
			require.NoError(t, err)
			t.Cleanup(d.Close)
			data := func(i int) []byte { return bytes.Repeat([]byte{byte(i)}, 100) }
			for i := 1; i <= 3; i++ {
				require.True(t, d.Spill("e", key(i), sum(data(i)), data(i)))
			}
			waitOnDisk(t, d, key(1), key(2), key(3))
			tomb := fixedHeader + int64(len(key(0))) + 4
			wrote := make(chan error, 16)
			d.mu.Lock()
			seg := d.segs[len(d.segs)-1]
			seg.out = &wroteFile{appendFile: &failingFile{f: seg.f, limit: 5, cutFails: cutFails}, wrote: wrote}
			d.mu.Unlock()

			d.Drop("e", key(1))
			require.ErrorIs(t, testkit.Recv(t, wrote, 10*time.Second, "the tombstone write"), errInjected)
			waitFailed(t, d, 1)

			d.Drop("e", key(2)) // the next wake: both tombstones
			waitTombstones(t, d, 2*tomb)
			if cutFails {
				require.Equal(t, int64(1), d.Stats().Retired, "the tombstones went to a new segment")
			}
			d2, err := Open(Config{Dir: copySegments(t, d), Bytes: 1 << 20}, nil)
			require.NoError(t, err)
			defer d2.Close()
			require.Equal(t, []messages.Key{key(3)}, d2.Keys(), "the dropped chunks stay out")
			if !cutFails {
				require.Zero(t, d2.Stats().Discarded, "the failed write was cut back: no torn bytes")
			}
		})
	}
}

// A failed tombstone write on a tier nothing else wakes is tried again
// after TombstoneRetry: the dropped record does not wait for Close (or a
// crash, which would bring it back) to stay dropped.
func TestAFailedTombstoneWriteIsRetriedOnAQuietTier(t *testing.T) {
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20, TombstoneRetry: 10 * time.Millisecond}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	data := bytes.Repeat([]byte{7}, 100)
	require.True(t, d.Spill("e", key(1), sum(data), data))
	require.True(t, d.Spill("e", key(2), sum(data), data))
	waitOnDisk(t, d, key(1), key(2))
	wrote := make(chan error, 16)
	d.mu.Lock()
	seg := d.segs[len(d.segs)-1]
	seg.out = &wroteFile{appendFile: &failingFile{f: seg.f, limit: 5}, wrote: wrote}
	d.mu.Unlock()

	d.Drop("e", key(1))
	require.ErrorIs(t, testkit.Recv(t, wrote, 10*time.Second, "the tombstone write"), errInjected)
	require.NoError(t, testkit.Recv(t, wrote, 10*time.Second, "the retry"), "no wake but the retry's")
	waitTombstones(t, d, fixedHeader+int64(len(key(0)))+4)
	require.Equal(t, int64(1), d.Stats().Failed)

	d2, err := Open(Config{Dir: copySegments(t, d), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d2.Close()
	require.Equal(t, []messages.Key{key(2)}, d2.Keys(), "the dropped chunk stays out")
}

func waitFailed(t *testing.T, d *Disk, want int64) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if got := d.Stats().Failed; got != want {
			return fmt.Errorf("%d failed writes, want %d", got, want)
		}
		return nil
	})
}

// brokenFile fails every write (its truncates succeed, so the segment is
// cut back and kept: the failure goes on).
type brokenFile struct {
	appendFile
	tried chan time.Time
}

func (b *brokenFile) Write([]byte) (int, error) {
	b.tried <- time.Now()
	return 0, errInjected
}

// A tombstone write that keeps failing is retried ever more slowly
// (TombstoneRetry, doubled per failure in a row): a disk that cannot be
// written is not tried every TombstoneRetry for ever, each failure that
// cannot be cut back retiring a segment and the retry starting another.
func TestAFailingTombstoneWriteIsRetriedEverMoreSlowly(t *testing.T) {
	const retry = 20 * time.Millisecond
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20, TombstoneRetry: retry}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	data := bytes.Repeat([]byte{7}, 100)
	require.True(t, d.Spill("e", key(1), sum(data), data))
	waitOnDisk(t, d, key(1))
	tried := make(chan time.Time, 16)
	d.mu.Lock()
	seg := d.segs[len(d.segs)-1]
	seg.out = &brokenFile{appendFile: seg.out, tried: tried}
	d.mu.Unlock()

	d.Drop("e", key(1))
	at := make([]time.Time, 4)
	for i := range at {
		at[i] = testkit.Recv(t, tried, 10*time.Second, "a tombstone write")
	}
	for i := 1; i < len(at); i++ { // timers never fire early: lower bounds hold on any machine
		require.GreaterOrEqual(t, at[i].Sub(at[i-1]), retry<<(i-1), "retry %d", i)
	}
	require.GreaterOrEqual(t, d.Stats().Failed, int64(3))
}

// The files are kept under 1.5x the budget in records, tombstones not
// counted: the run checks the bound before the tombstones of what it just
// dropped are written, the rebuild after, so were they counted, a restart
// would delete the oldest segment, live chunks and all, that the run kept.
// Here the files hold 1360 bytes of records and 144 of tombstones, over
// 1.5x the budget (1500) only with the tombstones, the last written after
// the run's last check.
func TestTombstonesDoNotCountAgainstTheFilesBound(t *testing.T) {
	dir := t.TempDir()
	// 100-byte chunks in 136-byte records, three to a segment; tombstones
	// of 36 bytes.
	cfg := Config{Dir: dir, Bytes: 1000, SegmentBytes: 500}
	d, err := Open(cfg, nil)
	require.NoError(t, err)
	data := func(i int) []byte { return bytes.Repeat([]byte{byte(i)}, 100) }
	var keys []messages.Key
	for i := 1; i <= 10; i++ {
		require.True(t, d.Spill("e", key(i), sum(data(i)), data(i)))
		keys = append(keys, key(i))
	}
	waitOnDisk(t, d, keys...)
	tomb := fixedHeader + int64(len(key(0))) + 4
	for n, i := range []int{7, 8, 9, 10} {
		d.Drop("e", key(i))
		waitTombstones(t, d, int64(n+1)*tomb)
	}
	require.Equal(t, keys[:6], d.Keys(), "the run keeps the oldest segment")
	require.Equal(t, int64(1360+4*tomb), d.Stats().FileBytes)
	d.Close()

	d2, err := Open(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, keys[:6], d2.Keys(), "so does a restart")
	for i := 1; i <= 6; i++ {
		got, err := readBack(t, d2, key(i), 100)
		require.NoError(t, err)
		require.Equal(t, data(i), got, "chunk %d", i)
	}
	require.Zero(t, d2.Stats().Evictions)
}

// A record evicted past the budget whose segment is deleted before the
// writer gets to its tombstone (here in the same flush: the evicted chunk
// was its segment's last) gets none: nothing can bring that record back,
// and the tombstone would only take room in the files (counted against
// nothing, kept until its own segment goes). The files hold the two live
// chunks' records and nothing else, and a restart keeps those two.
func TestATombstoneOfADeletedSegmentIsNotWritten(t *testing.T) {
	dir := t.TempDir()
	// Two 100-byte chunks fit; each record is its segment's only one.
	cfg := Config{Dir: dir, Bytes: 250, SegmentBytes: 100}
	ev := &events{}
	d, err := Open(cfg, ev.notify)
	require.NoError(t, err)
	data := func(i int) []byte { return bytes.Repeat([]byte{byte(i)}, 100) }
	for i := 1; i <= 3; i++ {
		require.True(t, d.Spill("e", key(i), sum(data(i)), data(i)))
		waitOnDisk(t, d, key(i))
	}
	_, removed := ev.get()
	require.Equal(t, []messages.Key{key(1)}, removed, "chunk 1 evicted, its segment deleted")
	d.Close() // the writer has written every tombstone it will
	record := headerLen(key(0)) + 100
	sizes := map[string]int64{}
	for _, f := range segFiles(t, dir) {
		info, err := os.Stat(f)
		require.NoError(t, err)
		sizes[filepath.Base(f)] = info.Size()
	}
	require.Equal(t, map[string]int64{"00000002" + segSuffix: record, "00000003" + segSuffix: record}, sizes,
		"the live chunks' records, no tombstone")

	d2, err := Open(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, []messages.Key{key(2), key(3)}, d2.Keys())
	for i := 2; i <= 3; i++ {
		got, err := readBack(t, d2, key(i), 100)
		require.NoError(t, err)
		require.Equal(t, data(i), got, "chunk %d", i)
	}
}

// A record's header checksum covers its key: a key byte rotted on disk is
// a torn header (the segment cut there), never a record of another key,
// whose data checksum, over the data alone, would hold: the chunk would
// be served under a key, of another namespace maybe, that never stored it.
func TestARottedKeyByteIsATornHeaderNotAnotherKey(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{5}, 1000)
	for i := 1; i <= 3; i++ {
		require.True(t, d.Spill("e", key(i), sum(c), c))
	}
	waitOnDisk(t, d, key(1), key(2), key(3))
	path, off, _ := d.Where(key(2))
	d.Close()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	last := off - 4 - 1                   // the key's last byte, before the header checksum
	_, err = f.WriteAt([]byte{'9'}, last) // "chunk-000002" reads "chunk-000009"
	require.NoError(t, err)
	require.NoError(t, f.Close())

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	_, _, ok := d2.Has(key(9))
	require.False(t, ok, "a key no record was written under")
	require.Equal(t, []messages.Key{key(1)}, d2.Keys(), "cut at the torn header")
	require.Equal(t, int64(1), d2.Stats().Discarded)
}

// A torn tail is cut at the record it tears, and the segment's size is
// where the cut left it: the writer appends to a newest segment with no
// live chunk (here a dropped record and its tombstone, then a torn
// header), and its records are indexed where they land, so they read
// back; the files' bytes are counted as they are.
func TestATornTailCutLeavesTheSegmentToAppendAtItsEnd(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{Dir: dir, Bytes: 1 << 20}
	d, err := Open(cfg, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{6}, 1000)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	d.Drop("e", key(1)) // its tombstone beside it: the segment holds no live chunk
	d.Close()
	files, err := filepath.Glob(filepath.Join(dir, "*"+segSuffix))
	require.NoError(t, err)
	require.Len(t, files, 1)
	f, err := os.OpenFile(files[0], os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.Write(appendHeader(nil, string(key(2)), 1000, sum(c))[:10]) // a header torn
	require.NoError(t, err)
	require.NoError(t, f.Close())

	d, err = Open(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	require.Equal(t, int64(1), d.Stats().Discarded)
	require.True(t, d.Spill("e", key(3), sum(c), c))
	waitOnDisk(t, d, key(3))
	path, _, _ := d.Where(key(3))
	require.Equal(t, files[0], path, "appended to the cut segment")
	got, err := readBack(t, d, key(3), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got)
	info, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, info.Size(), d.Stats().FileBytes)
}

// Close writes the tombstones still queued (here one whose write failed,
// its retry an hour off): a Close then a restart brings back no record
// dropped before the Close.
func TestCloseWritesTheTombstonesStillQueued(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, TombstoneRetry: time.Hour}, nil)
	require.NoError(t, err)
	data := bytes.Repeat([]byte{7}, 100)
	require.True(t, d.Spill("e", key(1), sum(data), data))
	require.True(t, d.Spill("e", key(2), sum(data), data))
	waitOnDisk(t, d, key(1), key(2))
	failWrites(d, 5, false)
	d.Drop("e", key(1))
	waitFailed(t, d, 1)
	d.Close()

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d2.Close()
	require.Equal(t, []messages.Key{key(2)}, d2.Keys(), "the dropped chunk stays out")
}

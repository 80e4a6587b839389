package disk

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// failingReader reads r until at bytes have been read, then fails as a
// disk does (EIO), once, the file itself unharmed.
type failingReader struct {
	r  io.Reader
	at int64
	n  int64
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n >= f.at {
		return 0, &os.PathError{Op: "read", Path: "segment", Err: syscall.EIO}
	}
	p = p[:min(int64(len(p)), f.at-f.n)]
	n, err := f.r.Read(p)
	f.n += int64(n)
	return n, err
}

// A read that fails at open (EIO) is not a torn tail: the open fails,
// naming the segment and the error, and cuts nothing, so the records after
// the failure are all there at the next open.
func TestAReadErrorAtOpenFailsItAndCutsNothing(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{3}, 1000)
	for i := range 3 {
		require.True(t, d.Spill("e", key(i), sum(c), c))
		waitOnDisk(t, d, key(i))
	}
	path, off, _ := d.Where(key(1))
	d.Close()
	before, err := os.Stat(path)
	require.NoError(t, err)

	fail := func(p string, r io.Reader) io.Reader {
		if p != path {
			return r
		}
		return &failingReader{r: r, at: off + 10} // inside key(1)'s data
	}
	_, err = Open(Config{Dir: dir, Bytes: 1 << 20, readSegment: fail}, nil)
	require.ErrorIs(t, err, syscall.EIO)
	require.ErrorContains(t, err, path)
	after, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, before.Size(), after.Size(), "nothing cut")

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err, "the directory is not left locked")
	defer d2.Close()
	for i := range 3 {
		got, err := readBack(t, d2, key(i), len(c))
		require.NoError(t, err)
		require.Equal(t, c, got)
	}
	require.Zero(t, d2.Stats().Discarded)
}

// openTwoSegments opens a tier on dir that writes each 1000-byte record
// to a segment of its own, and spills key(1) and key(2), waiting until both
// are on disk.
func openTwoSegments(t *testing.T, dir string, notify Notify) (*Disk, []byte) {
	t.Helper()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1500}, notify)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{5}, 1000)
	for i := 1; i <= 2; i++ {
		require.True(t, d.Spill("e", key(i), sum(c), c))
		waitOnDisk(t, d, key(i))
	}
	return d, c
}

// A Drop (or a load's read that fails) after Close changes nothing: it
// deleted the segment left with no live record although the tier no
// longer held the directory, so a tier opened on it since lost the file,
// and it announced a removal whose tombstone no writer would write.
func TestADropAfterCloseTouchesNoFile(t *testing.T) {
	dir := t.TempDir()
	ev := &events{}
	d, c := openTwoSegments(t, dir, ev.notify)
	path1, _, _ := d.Where(key(1))
	d.Close()

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d2.Close()
	d.Drop("e", key(1)) // the last record of the oldest segment
	_, err = readBack(t, d, key(2), len(c))
	require.Error(t, err, "a closed tier serves nothing")

	_, err = os.Stat(path1)
	require.NoError(t, err, "the segment the new tier holds is still there")
	_, removed := ev.get()
	require.Empty(t, removed)
	got, err := readBack(t, d2, key(1), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got)
	d2.Close()
	d3, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d3.Close()
	require.ElementsMatch(t, []messages.Key{key(1), key(2)}, d3.Keys(), "both chunks come back")
}

// segBytes is the bytes the directory's segment files take.
func segBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	for _, f := range segFiles(t, dir) {
		st, err := os.Stat(f)
		require.NoError(t, err)
		n += st.Size()
	}
	return n
}

// A segment whose file fails to delete stays whole: its bytes counted
// (Stats.FileBytes is what the files take), its chunks served, the failure
// counted once; the next drop deletes it. The failed delete was ignored
// and the bytes counted freed while the file stayed.
func TestAFailedSegmentDeleteKeepsTheSegmentAndItsBytes(t *testing.T) {
	dir := t.TempDir()
	var failing atomic.Bool
	failing.Store(true)
	remove := func(path string) error {
		if failing.Load() {
			return &os.PathError{Op: "remove", Path: path, Err: syscall.EACCES}
		}
		return os.Remove(path)
	}
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1500, remove: remove}, nil)
	require.NoError(t, err)
	defer d.Close()
	c := bytes.Repeat([]byte{5}, 1000)
	for i := 1; i <= 3; i++ { // a segment each
		require.True(t, d.Spill("e", key(i), sum(c), c))
		waitOnDisk(t, d, key(i))
	}
	require.Equal(t, segBytes(t, dir), d.Stats().FileBytes)

	d.Drop("e", key(1)) // its segment, the oldest, is dead: the delete fails
	d.Drop("e", key(2)) // a dead one behind it waits for it
	require.Len(t, segFiles(t, dir), 3)
	filesCounted(t, d, dir) // the bytes still on disk are counted
	require.Equal(t, int64(1), d.Stats().RemoveFailed, "counted once, tried again at the second drop")
	got, err := readBack(t, d, key(3), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got)

	failing.Store(false)
	d.Drop("e", key(3)) // the next drop deletes both dead segments, then key(3)'s
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if n := len(segFiles(t, dir)); n != 1 {
			return fmt.Errorf("%d segment files", n)
		}
		return nil
	})
	filesCounted(t, d, dir)
	require.Equal(t, int64(1), d.Stats().RemoveFailed)
}

// filesCounted waits until Stats.FileBytes is what the segment files take
// (the writer writes the drops' tombstones after they return).
func filesCounted(t *testing.T, d *Disk, dir string) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n, files := d.Stats().FileBytes, segBytes(t, dir); n != files {
			return fmt.Errorf("FileBytes %d, the files take %d", n, files)
		}
		return nil
	})
}

// A segment cut short under the running tier (an operator's truncate, a
// filesystem's damage) fails the read of a chunk it held (ErrCorrupt,
// naming the key), never returns its bytes, and drops the chunk, told
// removed, so the next load of it is a miss; the tier goes on.
func TestAReadThatFailsDropsItsChunk(t *testing.T) {
	ev := &events{}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := bytes.Repeat([]byte{8}, 4096)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	require.True(t, d.Spill("e", key(2), sum(c), c))
	waitOnDisk(t, d, key(1), key(2))
	path, off, _ := d.Where(key(2))
	require.NoError(t, os.Truncate(path, off+100)) // key(2)'s data cut short

	_, err = readBack(t, d, key(2), len(c))
	require.ErrorIs(t, err, ErrCorrupt)
	require.Contains(t, err.Error(), fmt.Sprintf("%x", string(key(2))))
	_, _, ok := d.Has(key(2))
	require.False(t, ok, "dropped")
	_, removed := ev.get()
	require.Equal(t, []messages.Key{key(2)}, removed)
	_, err = readBack(t, d, key(2), len(c))
	require.ErrorIs(t, err, ErrMissing, "a miss now")
	got, err := readBack(t, d, key(1), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got, "the chunk before the cut still reads")
}

// A segment file deleted under the running tier (an operator's rm, a
// cleaner) counts as deleted when its turn comes: nothing fails to
// delete, and the segments after it are deleted in their turn, so the
// files stay within their bound. A delete that failed on the missing file
// would stop every later delete: the files would grow without bound.
func TestASegmentDeletedUnderTheTierIsNoFailedDelete(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 64 << 10, SegmentBytes: 16 << 10}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := bytes.Repeat([]byte{6}, 4<<10)
	require.True(t, d.Spill("e", key(0), sum(c), c))
	waitOnDisk(t, d, key(0))
	path, _, _ := d.Where(key(0))
	require.NoError(t, os.Remove(path))
	for i := 1; i < 100; i++ {
		require.True(t, d.Spill("e", key(i), sum(c), c))
		waitOnDisk(t, d, key(i))
	}
	st := d.Stats()
	require.Zero(t, st.RemoveFailed)
	require.LessOrEqual(t, st.FileBytes, int64(96<<10)+int64(16<<10)+int64(4<<10+64))
	require.LessOrEqual(t, len(segFiles(t, dir)), 8)
}

// A directory moved away under the running tier fails the spill that
// needs a new segment (counted; the full segment is not written past
// SegmentBytes, nor is a retired one appended to): the chunk is not
// indexed, and once the directory is back the tier writes again.
func TestANewSegmentThatCannotBeCreatedFailsTheSpillOnly(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "disk")
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1500}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := bytes.Repeat([]byte{7}, 1000) // one record per segment: each spill rolls
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	moved := dir + ".moved"
	require.NoError(t, os.Rename(dir, moved))
	require.True(t, d.Spill("e", key(2), sum(c), c))
	waitFailed(t, d, 1)
	_, _, ok := d.Has(key(2))
	require.False(t, ok)
	for _, f := range segFiles(t, moved) {
		info, err := os.Stat(f)
		require.NoError(t, err)
		require.LessOrEqual(t, info.Size(), int64(1500), "no segment written past SegmentBytes")
	}
	require.NoError(t, os.Rename(moved, dir))
	require.True(t, d.Spill("e", key(3), sum(c), c))
	waitOnDisk(t, d, key(3))
	got, err := readBack(t, d, key(3), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got)
}

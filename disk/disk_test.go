package disk

import (
	"bufio"
	"bytes"
	"fmt"
	"hash/crc32"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// content is the deterministic bytes of chunk i (sizes vary, up to 512 KiB).
func content(i int) []byte {
	rng := rand.New(rand.NewSource(int64(i)))
	b := make([]byte, 1+rng.Intn(512<<10))
	rng.Read(b)
	return b
}

func key(i int) messages.Key { return messages.Key(fmt.Sprintf("chunk-%06d", i)) }

func sum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// events records Notify calls.
type events struct {
	mu              sync.Mutex
	stored, removed []messages.Key
}

func (e *events) notify(_ string, stored, removed []messages.Key) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stored = append(e.stored, stored...)
	e.removed = append(e.removed, removed...)
}

func (e *events) get() (stored, removed []messages.Key) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]messages.Key(nil), e.stored...), append([]messages.Key(nil), e.removed...)
}

func waitOnDisk(t *testing.T, d *Disk, keys ...messages.Key) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		for _, k := range keys {
			if _, _, ok := d.Has(k); !ok {
				return fmt.Errorf("%s not on disk yet", k)
			}
		}
		return nil
	})
}

func readBack(t *testing.T, d *Disk, k messages.Key, size int) ([]byte, error) {
	t.Helper()
	b := make([]byte, size)
	half := size / 2 // two extents, as a chunk cut into pieces
	_, err := d.readInto("e", k, [][]byte{b[:half], b[half:]})
	return b, err
}

// A spilled chunk is written, announced as stored, and read back byte for
// byte; past the budget the least recently used go, announced as removed.
func TestSpillReadAndLRU(t *testing.T) {
	ev := &events{}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 3 << 10}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	chunk := func(i int) []byte { return []byte(strings.Repeat(string(rune('a'+i)), 1<<10)) }
	for i := range 3 {
		require.True(t, d.Spill("e", key(i), sum(chunk(i)), chunk(i)))
	}
	waitOnDisk(t, d, key(0), key(1), key(2))
	got, err := readBack(t, d, key(0), 1<<10) // 0 is now the most recent
	require.NoError(t, err)
	require.Equal(t, chunk(0), got)
	require.True(t, d.Spill("e", key(3), sum(chunk(3)), chunk(3)))
	waitOnDisk(t, d, key(3))
	_, _, ok := d.Has(key(1))
	require.False(t, ok, "the least recently used goes")
	stored, removed := ev.get()
	require.Equal(t, []messages.Key{key(0), key(1), key(2), key(3)}, stored)
	require.Equal(t, []messages.Key{key(1)}, removed)
	st := d.Stats()
	require.Equal(t, int64(3<<10), st.Bytes)
	require.Equal(t, 3, st.Chunks)
	require.Equal(t, int64(1), st.Evictions)
	require.Equal(t, int64(1), st.Hits)
	_, err = readBack(t, d, key(1), 1<<10)
	require.ErrorIs(t, err, ErrMissing)
}

// A chunk larger than the writer's queue (QueueBytes) is taken into an
// empty queue and written, so an engine whose chunks are over the 64 MiB
// default (the node sets no other) still spills; while it is queued or being
// written nothing more is taken, so the spilled bytes held stay under
// max(QueueBytes, one chunk).
func TestChunkOverQueueBytesSpillsIntoAnEmptyQueue(t *testing.T) {
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 16 << 20, QueueBytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	held := holdWrites(d)
	big := bytes.Repeat([]byte("B"), 2<<20)
	require.True(t, d.Spill("e", key(1), sum(big), big), "a chunk over QueueBytes into an empty queue")
	select {
	case <-held.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the writer never began writing the large chunk")
	}
	small := []byte("s")
	require.False(t, d.Spill("e", key(2), sum(small), small), "taken while the large chunk is held")
	close(held.release)
	waitOnDisk(t, d, key(1))
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if q := d.Stats().Queued; q != 0 {
			return fmt.Errorf("%d bytes still queued", q)
		}
		return nil
	})
	require.True(t, d.Spill("e", key(2), sum(small), small), "the queue is empty again")
	waitOnDisk(t, d, key(2))
	got, err := readBack(t, d, key(1), len(big))
	require.NoError(t, err)
	require.Equal(t, big, got)
	require.Equal(t, int64(1), d.Stats().Dropped)
}

// heldFile is a segment file whose first write waits for release (entered
// says it began), so a test can see what Spill takes while the writer is busy.
type heldFile struct {
	appendFile
	entered, release chan struct{}
	once             sync.Once
}

func (h *heldFile) Write(b []byte) (int, error) {
	h.once.Do(func() {
		close(h.entered)
		<-h.release
	})
	return h.appendFile.Write(b)
}

// holdWrites makes the current segment's next write wait for the returned
// file's release; the writer goroutine has nothing queued meanwhile.
func holdWrites(d *Disk) *heldFile {
	d.mu.Lock()
	defer d.mu.Unlock()
	seg := d.segs[len(d.segs)-1]
	h := &heldFile{appendFile: seg.out, entered: make(chan struct{}), release: make(chan struct{})}
	seg.out = h
	return h
}

// Bytes that changed between the checksum and the copy-out are never
// written; a chunk whose record is corrupted on disk is never returned
// whole: the read fails naming the key and the chunk is dropped, announced
// removed.
func TestCorruptNeverServed(t *testing.T) {
	ev := &events{}
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	good := []byte(strings.Repeat("x", 4096))
	require.True(t, d.Spill("e", key(1), sum(good)^1, good)) // raced: sum is of other bytes
	require.True(t, d.Spill("e", key(2), sum(good), good))
	waitOnDisk(t, d, key(2))
	_, _, ok := d.Has(key(1))
	require.False(t, ok)
	require.Equal(t, int64(1), d.Stats().Raced)

	flipAt(t, d, key(2), 100)
	_, err = readBack(t, d, key(2), 4096)
	require.ErrorIs(t, err, ErrCorrupt)
	require.Contains(t, err.Error(), fmt.Sprintf("%x", string(key(2))))
	_, _, ok = d.Has(key(2))
	require.False(t, ok, "dropped")
	_, removed := ev.get()
	require.Equal(t, []messages.Key{key(2)}, removed)
}

// flipAt flips one data byte of key's record.
func flipAt(t *testing.T, d *Disk, k messages.Key, at int64) {
	t.Helper()
	path, off, ok := d.Where(k)
	require.True(t, ok)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	b := make([]byte, 1)
	_, err = f.ReadAt(b, off+at)
	require.NoError(t, err)
	b[0] ^= 0x10
	_, err = f.WriteAt(b, off+at)
	require.NoError(t, err)
}

// Open rebuilds the index from the segments: intact records come back in
// write order; a record whose data fails its checksum is skipped; a torn
// tail (a record cut short) is cut off; foreign files are left alone.
func TestRebuildDiscardsTornAndBadRecords(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 64 << 20, SegmentBytes: 64 << 20}, nil)
	require.NoError(t, err)
	for i := range 6 {
		c := content(i)
		require.True(t, d.Spill("e", key(i), sum(c), c))
	}
	waitOnDisk(t, d, key(5))
	flipAt(t, d, key(2), 7) // bit rot inside a whole record
	path, off, _ := d.Where(key(5))
	d.Close()
	require.NoError(t, os.Truncate(path, off+10)) // the last record torn mid-data
	require.NoError(t, os.WriteFile(filepath.Join(dir, "README"), []byte("not a segment"), 0o600))

	d2, err := Open(Config{Dir: dir, Bytes: 64 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, []messages.Key{key(0), key(1), key(3), key(4)}, d2.Keys())
	require.Equal(t, int64(2), d2.Stats().Discarded)
	for _, i := range []int{0, 1, 3, 4} {
		want := content(i)
		got, err := readBack(t, d2, key(i), len(want))
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	info, err := os.Stat(path)
	require.NoError(t, err)
	_, off4, _ := d2.Where(key(4))
	require.Equal(t, off4+int64(len(content(4))), info.Size(), "the torn tail was cut")
	_, err = os.Stat(filepath.Join(dir, "README"))
	require.NoError(t, err, "foreign files are left alone")
}

// Writer and rebuild share one bound on a key's length: a key longer than a
// record holds is refused at Spill and by the writer (counted dropped),
// never written, so it cannot be taken for a torn header at the next open
// and cut its segment there with every record after it; a key of exactly
// the bound is written and comes back.
func TestKeyLongerThanARecordHoldsIsNotWrittenAndCutsNothing(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	data := func(b byte) []byte { return bytes.Repeat([]byte{b}, 1000) }
	tooLong := messages.Key(strings.Repeat("k", maxKeyLen+1))
	longest := messages.Key(strings.Repeat("l", maxKeyLen))
	require.True(t, d.Spill("e", key(1), sum(data(1)), data(1)))
	require.False(t, d.Spill("e", tooLong, sum(data(2)), data(2)), "a key no record holds")
	require.True(t, d.Spill("e", longest, sum(data(3)), data(3)))
	require.True(t, d.Spill("e", key(4), sum(data(4)), data(4)))
	waitOnDisk(t, d, key(1), longest, key(4))
	w := &writer{d: d} // the writer refuses it too, had it been queued
	w.batch = []spill{{"e", tooLong, sum(data(2)), data(2)}}
	w.write()
	_, _, ok := d.Has(tooLong)
	require.False(t, ok)
	require.Equal(t, int64(2), d.Stats().Dropped)
	d.Close()

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, []messages.Key{key(1), longest, key(4)}, d2.Keys(), "every record written comes back")
	require.Zero(t, d2.Stats().Discarded)
	for i, k := range []messages.Key{key(1), longest, key(4)} {
		got, err := readBack(t, d2, k, 1000)
		require.NoError(t, err)
		require.Equal(t, data([]byte{1, 3, 4}[i]), got)
	}
}

// Dropped records' room comes back: a segment with no live record is
// deleted, and the files never hold more than 1.5x the budget plus a segment.
func TestSegmentsReclaimed(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 64 << 10, SegmentBytes: 16 << 10}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := []byte(strings.Repeat("z", 4<<10))
	for i := range 200 {
		require.True(t, d.Spill("e", key(i), sum(c), c))
		waitOnDisk(t, d, key(i))
		st := d.Stats()
		require.LessOrEqual(t, st.Bytes, int64(64<<10))
		require.LessOrEqual(t, st.FileBytes, int64(96<<10)+int64(16<<10)+int64(4<<10+64))
	}
	files, err := filepath.Glob(filepath.Join(dir, "*"+segSuffix))
	require.NoError(t, err)
	require.LessOrEqual(t, len(files), 8)
}

// childEnv makes the test binary a spilling child (TestMain below).
const childEnv = "KVACTORS_DISK_SPILL_CHILD"

func TestMain(m *testing.M) {
	if dir := os.Getenv(childEnv); dir != "" {
		spillForever(dir)
		return
	}
	os.Exit(m.Run())
}

// spillForever spills chunks 0, 1, 2, … as fast as the writer takes them
// and prints each index once it is on disk, until it is killed.
func spillForever(dir string) {
	d, err := Open(Config{Dir: dir, Bytes: 256 << 20, QueueBytes: 8 << 20}, func(_ string, stored, _ []messages.Key) {
		for _, k := range stored {
			fmt.Println("stored", strings.TrimPrefix(string(k), "chunk-"))
		}
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	for i := 0; ; i++ {
		c := content(i)
		for !d.Spill("e", key(i), sum(c), c) {
			time.Sleep(100 * time.Microsecond) // the queue is full: let the writer drain it
		}
	}
}

// kill -9 during spill, then restart: every chunk the rebuilt index lists
// reads back byte-identical to what was spilled, none half-written is
// served, and every chunk announced stored before the kill survived.
func TestKill9DuringSpillThenRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	dir := t.TempDir()
	for round := range 3 { // kill at three different points
		cmd := exec.Command(os.Args[0], "-test.run", "^$")
		cmd.Env = append(os.Environ(), childEnv+"="+dir)
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		cmd.Stderr = os.Stderr
		require.NoError(t, cmd.Start())
		stored := map[int]bool{}
		lines := make(chan string, 1024)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				lines <- sc.Text()
			}
			close(lines)
		}()
		target := 20 + 15*round
		deadline := time.After(30 * time.Second)
		for len(stored) < target {
			select {
			case l, ok := <-lines:
				require.True(t, ok, "child exited early")
				i, err := strconv.Atoi(strings.TrimPrefix(l, "stored "))
				require.NoError(t, err, l)
				stored[i] = true
			case <-deadline:
				t.Fatalf("child stored only %d chunks in 30s", len(stored))
			}
		}
		_, err = Open(Config{Dir: dir, Bytes: 256 << 20}, nil)
		require.ErrorIs(t, err, ErrLocked, "a second process opening the directory in use")
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL)) // the writer is always mid-append
		_ = cmd.Wait()
		for range lines { // drain what it printed before dying
		}

		d, err := Open(Config{Dir: dir, Bytes: 256 << 20}, nil) // the dead child's lock went with it
		require.NoError(t, err)
		listed := d.Keys()
		require.GreaterOrEqual(t, len(listed), target)
		on := map[messages.Key]bool{}
		for _, k := range listed {
			on[k] = true
			i, err := strconv.Atoi(strings.TrimPrefix(string(k), "chunk-"))
			require.NoError(t, err)
			want := content(i)
			got, err := readBack(t, d, k, len(want))
			require.NoError(t, err, "chunk %d", i)
			require.Equal(t, want, got, "chunk %d reads back byte-identical", i)
		}
		for i := range stored {
			require.True(t, on[key(i)], "chunk %d was announced stored before the kill", i)
		}
		d.Close()
		again, err := Open(Config{Dir: dir, Bytes: 256 << 20}, nil) // the cut tails stay cut
		require.NoError(t, err)
		require.Zero(t, again.Stats().Discarded, "a second open finds nothing torn")
		require.Equal(t, listed, again.Keys())
		again.Close()
		t.Logf("round %d: killed after %d announced; %d chunks on disk after restart, %d torn records discarded",
			round, len(stored), len(listed), d.Stats().Discarded)
	}
}

// A read that finds a record bad drops that record, not the key: if the key
// was spilled again while the read ran, the newer record stays and the
// reader is told the key it read is missing (its bytes were the old
// record's), not corrupt.
func TestBadReadDropsItsRecordNotANewerOne(t *testing.T) {
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	one, two := []byte(strings.Repeat("1", 512)), []byte(strings.Repeat("2", 512))
	require.True(t, d.Spill("e", key(1), sum(one), one))
	waitOnDisk(t, d, key(1))
	d.mu.Lock()
	old := d.items[key(1)]
	d.mu.Unlock()
	d.Drop("e", key(1))
	require.True(t, d.Spill("e", key(1), sum(two), two)) // spilled again meanwhile
	waitOnDisk(t, d, key(1))

	err = d.check("e", key(1), old, sum(one)^1, nil) // the old record's read came back bad
	require.ErrorIs(t, err, ErrMissing)
	_, _, still := d.Has(key(1))
	require.True(t, still, "the newer record stays")
	got, err := readBack(t, d, key(1), 512)
	require.NoError(t, err)
	require.Equal(t, two, got)

	d.mu.Lock()
	cur := d.items[key(1)]
	d.mu.Unlock()
	require.ErrorIs(t, d.check("e", key(1), cur, sum(two)^1, nil), ErrCorrupt, "a bad read of the current record drops it")
	_, _, still = d.Has(key(1))
	require.False(t, still)
}

// readInto reads one key's chunk into dst through ReadMany and returns its
// checksum: the tests' and benchmarks' one-key read.
func (d *Disk) readInto(engine string, key messages.Key, dst [][]byte) (uint32, error) {
	var sum [1]uint32
	_, err := d.ReadMany(engine, []messages.Key{key}, [][][]byte{dst}, sum[:])
	return sum[0], err
}

// docs/OPERATIONS.md "Disk tier": one Disk per directory. A second Open of
// a directory in use is ErrLocked and touches nothing: the first's record
// being written is not cut as a torn tail, nor its segments reused or
// deleted. Once the first closes, the directory opens again, its chunks
// still there.
func TestASecondOpenOfADirectoryInUseIsRefused(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := content(1)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	files := func() map[string]int64 { return dirSizes(t, dir) }
	before := files()

	_, err = Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.ErrorIs(t, err, ErrLocked)
	require.Contains(t, err.Error(), dir, "the error names the directory")
	require.Equal(t, before, files(), "the refused open changed no file")
	got, err := readBack(t, d, key(1), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got, "the first still serves its chunk")

	d.Close()
	again, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err, "the lock went with Close")
	defer again.Close()
	got, err = readBack(t, again, key(1), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got)
}

// Takes says whether Spill would queue a chunk now, and counts one it
// would not as dropped, as Spill does: the store asks before it copies.
func TestTakesIsSpillsAdmission(t *testing.T) {
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20, QueueBytes: 100}, nil)
	require.NoError(t, err)
	require.True(t, d.Takes(1000), "a chunk larger than the queue goes into an empty one")
	require.Zero(t, d.Stats().Dropped)
	d.Close()
	require.False(t, d.Takes(10), "closed")
	require.EqualValues(t, 1, d.Stats().Dropped)
	c := bytes.Repeat([]byte{1}, 10)
	require.False(t, d.Spill("e", key(1), sum(c), c))
	require.EqualValues(t, 2, d.Stats().Dropped)
}

// Reannounce tells Notify of every chunk on disk as stored, least recently
// used first (ReannouncePrefix: those of a prefix only), and nothing once
// closed.
func TestReannounceTellsEveryChunkAsStored(t *testing.T) {
	ev := &events{}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	for i := range 2 {
		require.True(t, d.Spill("e", key(i), sum(content(i)), content(i)))
	}
	waitOnDisk(t, d, key(0), key(1))
	d.Reannounce()
	stored, removed := ev.get()
	require.Equal(t, []messages.Key{key(0), key(1), key(0), key(1)}, stored)
	require.Empty(t, removed)
	// key(0) and key(1) are "chunk-000000" and "chunk-000001": only the
	// keys of the prefix are told.
	d.ReannouncePrefix("chunk-000001", nil)
	stored, _ = ev.get()
	require.Equal(t, []messages.Key{key(0), key(1), key(0), key(1), key(1)}, stored)
	d.Close()
	d.Reannounce()
	stored, _ = ev.get()
	require.Len(t, stored, 5, "nothing after Close")
}

// A read asking for another size than the record's fails without reading
// (not ErrCorrupt: the record is not at fault) and drops nothing: read
// into the wrong room, the good chunk would fail its checksum and go.
func TestAReadOfAnotherSizeKeepsTheChunk(t *testing.T) {
	ev := &events{}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := bytes.Repeat([]byte{9}, 1000)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	for _, size := range []int{999, 1001} {
		_, err = readBack(t, d, key(1), size)
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrCorrupt)
		require.NotErrorIs(t, err, ErrMissing)
	}
	_, removed := ev.get()
	require.Empty(t, removed)
	got, err := readBack(t, d, key(1), len(c))
	require.NoError(t, err)
	require.Equal(t, c, got)
}

// A spill of a key already on disk writes nothing (the store spills a
// chunk read back and evicted again).
func TestASpillOfAKeyOnDiskWritesNothing(t *testing.T) {
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	c := bytes.Repeat([]byte{1}, 1000)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	require.True(t, d.Spill("e", key(1), sum(c), c), "on disk already")
	require.True(t, d.Spill("e", key(2), sum(c), c))
	waitOnDisk(t, d, key(2)) // written after anything queued before it
	require.Equal(t, int64(2), d.Stats().Writes)
}

// A chunk found at open has no engine; its drop is told for the engine
// whose action dropped it.
func TestADropOfAChunkFoundAtOpenIsToldForTheDroppingEngine(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{2}, 1000)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	d.Close()
	var mu sync.Mutex
	var told []string
	d, err = Open(Config{Dir: dir, Bytes: 1 << 20}, func(engine string, _, removed []messages.Key) {
		mu.Lock()
		defer mu.Unlock()
		for range removed {
			told = append(told, engine)
		}
	})
	require.NoError(t, err)
	t.Cleanup(d.Close)
	d.Drop("e2", key(1))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"e2"}, told)
}

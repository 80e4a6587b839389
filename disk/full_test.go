package disk

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// smallFS makes the segment files of dir share a filesystem of capacity
// bytes: a write that would take the directory's files past it fails
// whole with ENOSPC, as a full filesystem's does (nothing of it lands).
type smallFS struct {
	mu       sync.Mutex // one write at a time, so the sizes read are the files'
	dir      string
	capacity int64
}

func (fs *smallFS) used() int64 {
	var n int64
	entries, _ := os.ReadDir(fs.dir)
	for _, e := range entries {
		if info, err := e.Info(); err == nil && info.Mode().IsRegular() {
			n += info.Size()
		}
	}
	return n
}

func (fs *smallFS) out(f *os.File) appendFile { return &smallFile{fs: fs, f: f} }

type smallFile struct {
	fs *smallFS
	f  *os.File
}

func (s *smallFile) Write(b []byte) (int, error) {
	s.fs.mu.Lock()
	defer s.fs.mu.Unlock()
	if s.fs.used()+int64(len(b)) > s.fs.capacity {
		return 0, &os.PathError{Op: "write", Path: s.f.Name(), Err: syscall.ENOSPC}
	}
	return s.f.Write(b)
}

func (s *smallFile) Truncate(size int64) error { return s.f.Truncate(size) }

// A filesystem no larger than --disk-bytes fills before the budget does
// (record headers, tombstones, dropped records, the segment being
// written): a write that finds it full deletes the oldest segment and goes
// on, instead of failing every later spill for good, and so does a
// restart on the same full directory. What the tier announces is what it
// holds, and every chunk it holds reads back whole.
func TestAFullFilesystemDoesNotStopTheTier(t *testing.T) {
	dir := t.TempDir()
	const budget = 8 << 20
	fs := &smallFS{dir: dir, capacity: budget}
	cfg := Config{Dir: dir, Bytes: budget, SegmentBytes: 1 << 20, segmentOut: fs.out}
	chunks := map[messages.Key][]byte{}
	spill := func(d *Disk, from, to int) {
		for i := from; i < to; i++ {
			c := bytes.Repeat([]byte{byte(i), byte(i >> 8)}, 32<<10) // 64 KiB
			chunks[key(i)] = c
			for !d.Spill("e", key(i), sum(c), c) { // the queue is full: let the writer catch up
				drained(t, d)
			}
		}
		drained(t, d)
	}
	ev := &events{}
	d, err := Open(cfg, ev.notify)
	require.NoError(t, err)
	spill(d, 0, 300) // 18.75 MiB through an 8 MiB budget on an 8 MiB filesystem
	full := d.Stats()
	require.Positive(t, full.Full, "the filesystem filled before the budget")
	spill(d, 300, 500)
	st := d.Stats()
	require.Greater(t, st.Writes-full.Writes, int64(150), "a full filesystem stopped the tier: %+v", st)
	checkHolds(t, d, ev, chunks)
	d.Close()

	ev = &events{}
	d, err = Open(cfg, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	held := d.Keys()
	ev.mu.Lock()
	ev.stored = append(ev.stored, held...) // what the rebuild holds: the node re-announces it
	ev.mu.Unlock()
	spill(d, 500, 600)
	require.Greater(t, d.Stats().Writes, int64(75), "after a restart on a full directory: %+v", d.Stats())
	checkHolds(t, d, ev, chunks)
	require.LessOrEqual(t, fs.used(), fs.capacity)
}

// drained waits until the writer has taken every queued spill.
func drained(t *testing.T, d *Disk) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if q := d.Stats().Queued; q > 0 {
			return fmt.Errorf("%d bytes queued", q)
		}
		return nil
	})
}

// checkHolds: what was announced stored and not removed since is what d
// holds, and each of those reads back as spilled.
func checkHolds(t *testing.T, d *Disk, ev *events, chunks map[messages.Key][]byte) {
	t.Helper()
	stored, removed := ev.get()
	believed := map[messages.Key]int{}
	for _, k := range stored {
		believed[k]++
	}
	for _, k := range removed {
		believed[k]--
	}
	var want []messages.Key
	for k, n := range believed {
		require.Contains(t, []int{0, 1}, n, "%s announced stored %d times more than removed", k, n)
		if n == 1 {
			want = append(want, k)
		}
	}
	got := d.Keys()
	slices.Sort(want)
	slices.Sort(got)
	require.Equal(t, want, got, "announced and held differ")
	require.NotEmpty(t, got)
	for _, k := range got {
		b, err := readBack(t, d, k, len(chunks[k]))
		require.NoError(t, err, "%s", k)
		require.True(t, bytes.Equal(chunks[k], b), "%s reads back other bytes", k)
	}
}

// A full filesystem is logged, a Warn naming the directory and what the
// tier holds, at most once per fullLogEvery however many writes find it
// full: the metric alone showed an operator watching logs nothing, and a
// line per write would flood them.
func TestAFullFilesystemIsLoggedOncePerInterval(t *testing.T) {
	dir := t.TempDir()
	const budget = 8 << 20
	fs := &smallFS{dir: dir, capacity: budget / 2} // it fills long before the budget
	var logs testkit.SyncBuffer
	var clock atomic.Int64
	cfg := Config{Dir: dir, Bytes: budget, SegmentBytes: 1 << 20, segmentOut: fs.out,
		Log: slog.New(slog.NewTextHandler(&logs, nil)), now: func() time.Time { return time.Unix(0, clock.Load()) }}
	d, err := Open(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	i := 0
	spillUntilFull := func(writes int64) {
		t.Helper()
		for full := d.Stats().Full + writes; d.Stats().Full < full; i++ {
			c := bytes.Repeat([]byte{byte(i), byte(i >> 8)}, 32<<10) // 64 KiB
			// Drained after each: the loop reads Full once the writer has taken it.
			for !d.Spill("e", key(i), sum(c), c) {
				drained(t, d)
			}
			drained(t, d)
		}
	}
	lines := func() []string {
		var out []string
		for line := range strings.Lines(logs.String()) {
			if strings.Contains(line, "filesystem is full") {
				out = append(out, line)
			}
		}
		return out
	}
	spillUntilFull(10)
	require.Len(t, lines(), 1, "10 full writes in one interval:\n%s", logs.String())
	line := lines()[0]
	require.Contains(t, line, "level=WARN")
	require.Contains(t, line, "dir="+dir)
	for _, attr := range []string{"chunks=", "bytes=", "budget_bytes=8388608", "full_writes=1"} {
		require.Contains(t, line, attr)
	}
	clock.Add(int64(fullLogEvery))
	spillUntilFull(10)
	require.Len(t, lines(), 2, "the next interval's full writes:\n%s", logs.String())
}

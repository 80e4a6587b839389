package disk

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// A small budget (here 4 KiB, 256-byte chunks, the default segment size)
// keeps the bound Config.Bytes states for every budget: the segment files
// hold at most half the budget again in records (tombstones aside), and
// with the tombstones at most one segment more; a 1 MiB segment floor let
// the one segment being written grow to ~860 KB of dropped records, and
// its deletion took nearly all the live chunks with it. Chunks used in
// write order leave no segment deleted with live chunks in it: the tier
// holds the newest that fit its budget after every write. Chunks read back
// stay live in older segments, so segments are deleted with live chunks in
// them: each is announced removed, and the tier still holds at least half
// its budget after every write. Every chunk announced stored and not
// removed is in the index and reads back whole, before and after a reopen.
func TestSmallBudgetKeepsTheBoundOnDroppedRecords(t *testing.T) {
	t.Run("write order", func(t *testing.T) { testSmallBudget(t, false) })
	t.Run("read back", func(t *testing.T) { testSmallBudget(t, true) })
}

func testSmallBudget(t *testing.T, reads bool) {
	const budget, size, n = 4 << 10, 256, 2000
	data := func(i int) []byte {
		b := make([]byte, size)
		rand.New(rand.NewSource(int64(i))).Read(b)
		return b
	}
	var mu sync.Mutex
	live := map[messages.Key]bool{} // stored and not removed, as told
	stored := make(chan messages.Key, 64)
	notify := func(_ string, st, rm []messages.Key) {
		mu.Lock()
		for _, k := range st {
			live[k] = true
		}
		for _, k := range rm {
			delete(live, k)
		}
		mu.Unlock()
		for _, k := range st {
			stored <- k // one spill waited for at a time: never blocks
		}
	}
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: budget}, notify)
	require.NoError(t, err)
	const seg = budget / 4 // the most a segment of this budget holds

	dirBytes := func() int64 {
		files, err := filepath.Glob(filepath.Join(dir, "*"+segSuffix))
		require.NoError(t, err)
		var total int64
		for _, f := range files {
			info, err := os.Stat(f)
			require.NoError(t, err)
			total += info.Size()
		}
		return total
	}
	checkLive := func(d *Disk) {
		t.Helper()
		mu.Lock()
		want := make(map[messages.Key]bool, len(live))
		for k := range live {
			want[k] = true
		}
		mu.Unlock()
		got := map[messages.Key]bool{}
		for _, k := range d.Keys() {
			got[k] = true
		}
		require.Equal(t, want, got, "the index holds what was told stored and not removed")
		for k := range got {
			var i int
			_, err := fmt.Sscanf(string(k), "chunk-%06d", &i)
			require.NoError(t, err)
			b, err := readBack(t, d, k, size)
			require.NoError(t, err, "%s", k)
			require.True(t, bytes.Equal(data(i), b), "%s: bytes differ", k)
		}
	}

	for i := range n {
		c := data(i)
		require.True(t, d.Spill("e", key(i), sum(c), c))
		select {
		case k := <-stored:
			require.Equal(t, key(i), k)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s not written", key(i))
		}
		if reads && i%16 == 0 && i >= 8 { // kept live while its segment ages
			if _, _, ok := d.Has(key(i - 8)); ok {
				b, err := readBack(t, d, key(i-8), size)
				require.NoError(t, err)
				require.True(t, bytes.Equal(data(i-8), b))
			}
		}
		d.mu.Lock()
		files, records, used := d.fileBytes, d.fileBytes-d.markBytes, d.used
		d.mu.Unlock()
		require.LessOrEqual(t, records, int64(budget+budget/2), "records in the files after %d chunks", i+1)
		require.LessOrEqual(t, files, int64(budget+budget/2+seg), "files after %d chunks", i+1)
		switch {
		case i < budget/size:
		case !reads:
			require.Equal(t, int64(budget), used, "live bytes after %d chunks", i+1)
		default:
			require.GreaterOrEqual(t, used, int64(budget/2), "live bytes after %d chunks", i+1)
		}
		if reads && i%500 == 0 { // reads every chunk: not in write order
			checkLive(d)
		}
	}
	checkLive(d)
	d.Close()
	require.Equal(t, d.Stats().FileBytes, dirBytes(), "the files are what the tier counts")
	require.LessOrEqual(t, dirBytes(), int64(budget+budget/2+seg))

	d2, err := Open(Config{Dir: dir, Bytes: budget}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	checkLive(d2)
}

// The default segment size is a sixteenth of the budget, between 1 MiB and
// 256 MiB, and never more than a quarter of it; a SegmentBytes over 1.5 ×
// the budget is refused (the segment being written alone would pass the
// bound on dropped records), one up to it is taken.
func TestSegmentBytesFollowTheBudget(t *testing.T) {
	for budget, want := range map[int64]int64{
		1: 1, 4 << 10: 1 << 10, 1 << 20: 256 << 10, 4 << 20: 1 << 20, 16 << 20: 1 << 20,
		64 << 20: 4 << 20, 4 << 30: 256 << 20, 1 << 40: 256 << 20,
	} {
		require.Equal(t, want, defaultSegmentBytes(budget), "budget %d", budget)
	}
	_, err := Open(Config{Dir: t.TempDir(), Bytes: 4 << 10, SegmentBytes: 6<<10 + 1}, nil)
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "SegmentBytes 6145 over 1.5 × Bytes 4096")
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 4 << 10, SegmentBytes: 6 << 10}, nil)
	require.NoError(t, err)
	d.Close()
}

// A chunk larger than the whole budget is not written (counted dropped):
// indexed, it would have evicted every chunk on disk, then itself.
func TestAChunkOverTheBudgetIsNotWrittenAndEvictsNothing(t *testing.T) {
	ev := &events{}
	d, err := Open(Config{Dir: t.TempDir(), Bytes: 4 << 10}, ev.notify)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	small, big := bytes.Repeat([]byte{1}, 1<<10), bytes.Repeat([]byte{2}, 8<<10)
	require.True(t, d.Spill("e", key(1), sum(small), small))
	waitOnDisk(t, d, key(1))
	require.True(t, d.Spill("e", key(2), sum(big), big), "queued: the writer refuses it")
	require.True(t, d.Spill("e", key(3), sum(small), small))
	waitOnDisk(t, d, key(3)) // written after the big one was taken
	_, _, ok := d.Has(key(2))
	require.False(t, ok)
	require.Equal(t, []messages.Key{key(1), key(3)}, d.Keys())
	require.Equal(t, int64(1), d.Stats().Dropped)
	_, removed := ev.get()
	require.Empty(t, removed)
}

package disk

import (
	"container/list"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// A directory written under a large budget and reopened under a small one
// is rebuilt holding about what the budget keeps, not what the directory
// holds: the index never takes the records it will trim (indexing every
// record, then trimming, held all sixty). The newest chunks that fit are
// kept and read back byte for byte, the older segments are gone, and the
// chunk trimmed from the segment kept stays out when the budget grows again.
func TestRebuildUnderASmallerBudgetHoldsWhatTheBudgetKeeps(t *testing.T) {
	const (
		n        = 60
		chunk    = 1000
		perSeg   = 3 // 4 KiB segments of 1036-byte records
		kept     = 5
		segments = n / perSeg
	)
	data := func(i int) []byte {
		b := make([]byte, chunk)
		rand.New(rand.NewSource(int64(i))).Read(b)
		return b
	}
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 4 << 10}, nil)
	require.NoError(t, err)
	var all []messages.Key
	for i := range n {
		require.True(t, d.Spill("e", key(i), sum(data(i)), data(i)))
		all = append(all, key(i))
	}
	waitOnDisk(t, d, all...)
	d.Close()
	require.Len(t, segFiles(t, dir), segments)

	d2, err := Open(Config{Dir: dir, Bytes: kept*chunk + chunk/2}, nil)
	require.NoError(t, err)
	require.Equal(t, all[n-kept:], d2.Keys(), "the newest that fit")
	for i := n - kept; i < n; i++ {
		got, err := readBack(t, d2, key(i), chunk)
		require.NoError(t, err)
		require.Equal(t, data(i), got, "chunk %d", i)
	}
	// Held: the chunks kept, and one segment's records read (with the keys
	// of those it trims).
	require.LessOrEqual(t, d2.rebuildHeld, kept+2*perSeg)
	// The segments holding the chunks kept (and the new one), no other.
	require.Len(t, segFiles(t, dir), 2+1)
	d2.Close()

	d3, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d3.Close)
	require.Equal(t, all[n-kept:], d3.Keys(), "chunk %d, trimmed beside the kept, stays out", n-kept-1)
	require.Zero(t, d3.Stats().Discarded)
}

// The rebuild keeps what indexing every record in write order, then
// trimming to the budget, kept (rebuildAll, the rebuild as it was before
// it walked back from the newest segment), over random segment files:
// records of a few keys written again, tombstones naming records before
// them, after them or none, gaps in the ids, empty segments, bit rot and
// torn tails, any budget. The same chunks are kept in the same LRU order
// at the same places, the same segments kept with the same sizes, the
// same tombstones queued for the writer to write, and the directory is
// left the same.
func TestRebuildKeepsWhatIndexingEveryRecordKept(t *testing.T) {
	for seed := range int64(400) {
		rng := rand.New(rand.NewSource(seed))
		src := t.TempDir()
		total := randomSegments(t, rng, src)
		budget := []int64{1, 1 + rng.Int63n(total+1), total + 1, 1 << 20}[rng.Intn(4)]

		walked, all := t.TempDir(), t.TempDir()
		copyDir(t, src, walked)
		copyDir(t, src, all)
		got, want := bareDisk(walked, budget), bareDisk(all, budget)
		require.NoError(t, got.rebuild(), "seed %d", seed)
		require.NoError(t, want.rebuildAll(), "seed %d", seed)
		require.Equal(t, want.state(), got.state(), "seed %d, budget %d", seed, budget)
		require.LessOrEqual(t, got.evictions.Load(), want.evictions.Load(), "seed %d", seed)
		require.LessOrEqual(t, got.discarded.Load(), want.discarded.Load(), "seed %d", seed)
		got.closeFiles()
		want.closeFiles()
		require.Equal(t, dirSizes(t, all), dirSizes(t, walked), "seed %d", seed)
	}
}

// bareDisk is a Disk of dir with nothing open, for the rebuild alone.
func bareDisk(dir string, budget int64) *Disk {
	return &Disk{cfg: Config{Dir: dir, Bytes: budget, MaxChunks: defaultMaxChunks(budget)}, items: map[messages.Key]*item{}, lru: list.New()}
}

// rebuilt is what a rebuild leaves, to compare.
type rebuilt struct {
	Keys               []string // LRU order: key seg off size sum
	Segs               []string // id size marks live
	Tombs              []string // the ones the writer will write: key seg off
	Used, Files, Marks int64
}

func (d *Disk) state() rebuilt {
	var r rebuilt
	for e := d.lru.Front(); e != nil; e = e.Next() {
		it := e.Value.(*item)
		r.Keys = append(r.Keys, fmt.Sprintf("%s %d %d %d %d", it.key, it.seg.id, it.off, it.size, it.sum))
	}
	for _, s := range d.segs {
		r.Segs = append(r.Segs, fmt.Sprintf("%d %d %d %d", s.id, s.size, s.marks, s.live))
	}
	for _, t := range d.tombs {
		if len(d.segs) > 0 && t.seg >= d.segs[0].id {
			r.Tombs = append(r.Tombs, fmt.Sprintf("%s %d %d", t.key, t.seg, t.off))
		}
	}
	r.Used, r.Files, r.Marks = d.used, d.fileBytes, d.markBytes
	return r
}

// randomSegments writes random segment files to dir and returns the bytes
// of data in their records.
func randomSegments(t *testing.T, rng *rand.Rand, dir string) int64 {
	t.Helper()
	type rec struct {
		key string
		seg int
		off int64
	}
	var recs []rec
	var total int64
	id := 0
	for range 1 + rng.Intn(8) {
		id += 1 + rng.Intn(4)/3 // now and then a gap
		var b []byte
		entries := rng.Intn(12)
		if rng.Intn(10) == 0 {
			entries = 0 // a boot that wrote nothing
		}
		var offs []int64 // data offsets, for bit rot
		for range entries {
			if len(recs) == 0 || rng.Intn(4) > 0 {
				k := string(key(rng.Intn(8)))
				data := make([]byte, rng.Intn(60))
				rng.Read(data)
				b = appendHeader(b, k, int64(len(data)), sum(data))
				recs = append(recs, rec{k, id, int64(len(b))})
				offs = append(offs, int64(len(b)))
				b = append(b, data...)
				total += int64(len(data))
				continue
			}
			r := recs[rng.Intn(len(recs))]
			switch rng.Intn(8) {
			case 0:
				r.key = string(key(rng.Intn(8))) // perhaps another key's
			case 1:
				r.seg += rng.Intn(3) - 1 // perhaps a segment after it, or none
			case 2:
				r.off += int64(rng.Intn(3) - 1)
			}
			b = appendTombstone(b, r.key, r.seg, r.off)
		}
		if len(offs) > 0 && rng.Intn(6) == 0 { // bit rot in a record's data (or, at its end, the next header)
			at := offs[rng.Intn(len(offs))]
			if at < int64(len(b)) {
				b[at] ^= 0x40
			}
		}
		if len(b) > 0 && rng.Intn(6) == 0 { // a torn tail
			b = b[:rng.Intn(len(b))]
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("%08d%s", id, segSuffix)), b, 0o600))
	}
	return total
}

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	entries, err := os.ReadDir(from)
	require.NoError(t, err)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(from, e.Name()))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(to, e.Name()), b, 0o600))
	}
}

// dirSizes is each file's size, by name.
func dirSizes(t *testing.T, dir string) map[string]int64 {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	out := map[string]int64{}
	for _, e := range entries {
		info, err := e.Info()
		require.NoError(t, err)
		out[e.Name()] = info.Size()
	}
	return out
}

// rebuildAll is the rebuild as it was before it walked back from the
// newest segment, kept as the model of what the rebuild keeps: it indexes
// every intact record of every segment, in write order, leaving out
// records a tombstone names, then trims to the budget. It lists and reads
// segments as the rebuild does (segmentIDs, read): what is compared is
// which records are kept.
func (d *Disk) rebuildAll() error {
	ids, err := d.segmentIDs()
	if err != nil {
		return err
	}
	var entries []entry
	for _, id := range ids {
		f, err := os.OpenFile(d.segPath(id), os.O_RDWR|os.O_APPEND, 0)
		if err != nil {
			return fmt.Errorf("disk: %w", err)
		}
		seg := &segment{id: id, f: f, out: f}
		d.segs = append(d.segs, seg)
		if entries, err = d.read(seg, entries[:0]); err != nil {
			return err
		}
		if seg.size == 0 {
			d.segs = d.segs[:len(d.segs)-1]
			_ = f.Close()
			_ = os.Remove(f.Name())
			continue
		}
		d.fileBytes += seg.size
		d.markBytes += seg.marks
		for _, e := range entries {
			key := messages.Key(e.key)
			it, ok := d.items[key]
			switch {
			case e.tombstone:
				if ok && it.seg.id == e.seg && it.off == e.off {
					d.unindex(it)
				}
			default: // a later record of a key replaces an earlier one
				if ok {
					d.unindex(it)
				}
				d.index(&item{key: key, seg: seg, off: e.at, size: e.size, sum: e.sum})
			}
		}
	}
	for d.used > d.cfg.Bytes {
		d.evictFront()
	}
	d.dropDead()
	return nil
}

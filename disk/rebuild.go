package disk

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/kvactors/kvactors/messages"
)

// rebuild restores the index from the segments. It keeps what indexing
// every intact record in write order would keep (leaving out the records
// their tombstones name, a later record of a key replacing an earlier
// one), then trimming the earliest written to the budget: the longest run
// of the newest live records that fits. It finds that run walking back
// from the newest segment, so what it holds follows the budget, not the
// directory: the records it keeps, one segment's entries at a time, and
// the keys and tombstones of the dropped records it walks past (records a
// later one replaces, or a tombstone names), which are bounded too (see
// walk.bound). The walk stops with the segment where the budget fills up;
// every segment older than that holds no record kept, so it is deleted
// unread, as dropDead would delete it once read (its records are not
// counted as evictions, nor its torn or bad records as discarded). It also
// stops, logged, with the segment where the dropped records' keys and
// tombstones held pass their bound (a directory whose newest records are
// nearly all dropped, with live ones far back): the older segments are
// deleted unread as if the budget had filled there, so their live records
// are lost to the cache, but no record kept can be one a tombstone in them
// names (walk.bound says why). The records trimmed get tombstones, written
// once the writer starts; those of a deleted segment need none. The LRU
// order it starts with is write order (the order of use before the restart
// is not kept).
func (d *Disk) rebuild() error {
	ids, err := d.segmentIDs()
	if err != nil {
		return err
	}
	w := &walk{d: d, ids: ids, named: map[int]map[mark]struct{}{}, dead: map[messages.Key]struct{}{}}
	i := len(ids) - 1
	for ; i >= 0 && !w.full && !w.cut; i-- {
		// Open starts a new segment after the rebuild, so these are only
		// read and cut; O_APPEND all the same, so that a write to any
		// segment lands at its end, not where the read left the offset.
		f, err := os.OpenFile(d.segPath(ids[i]), os.O_RDWR|os.O_APPEND, 0)
		if err != nil {
			return fmt.Errorf("disk: %w", err)
		}
		seg := &segment{id: ids[i], f: f, out: f}
		d.segs = append(d.segs, seg) // newest first until the walk ends; closed by Open on an error
		if w.entries, err = d.read(seg, w.entries[:0]); err != nil {
			return err
		}
		if seg.size == 0 {
			// A boot that wrote nothing (a crash loop starts one per start):
			// no tombstone names a record in it, and were it the last, the
			// new segment takes its id afresh. Kept, one per start would pile
			// up behind a live older segment, each an open descriptor.
			d.segs = d.segs[:len(d.segs)-1]
			_ = f.Close()
			_ = os.Remove(f.Name())
			continue
		}
		d.fileBytes += seg.size
		d.markBytes += seg.marks
		w.segment(seg)
	}
	for _, id := range ids[:i+1] {
		_ = os.Remove(d.segPath(id)) // older than every record kept
	}
	if w.cut {
		d.rebuildCut = ids[i+1]
		slog.Warn("disk: the rebuild ended before the budget filled: the keys and tombstones of dropped "+
			"records walked past passed their bound; the older segments were deleted unread, chunks and all",
			"dir", d.cfg.Dir, "held", w.held, "bound", w.bound(), "chunks", len(d.items), "bytes", d.used,
			"budget_bytes", d.cfg.Bytes, "segments_deleted", i+1)
	}
	slices.Reverse(d.segs)
	d.tombs = append(d.tombs, w.trimmed...)
	d.dropDead()
	return nil
}

// segmentIDs lists the ids of the segment files in the directory, in
// write order.
func (d *Disk) segmentIDs() ([]int, error) {
	entries, err := os.ReadDir(d.cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	var ids []int
	for _, e := range entries {
		id, err := strconv.Atoi(strings.TrimSuffix(e.Name(), segSuffix))
		// One name per id, the one segPath gives ("7.kvseg" or "+1.kvseg",
		// a stray copy, would be opened as another file or scanned twice),
		// and ids a tombstone can name (32 bits).
		if err != nil || !strings.HasSuffix(e.Name(), segSuffix) || !e.Type().IsRegular() ||
			id < 1 || id > maxSegmentID || filepath.Base(d.segPath(id)) != e.Name() {
			continue // not ours
		}
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids, nil
}

// walk is the rebuild's state as it walks back through the segments.
type walk struct {
	d       *Disk
	ids     []int   // the segments in the directory, in write order
	entries []entry // the segment being walked
	// named holds the tombstones walked past, by the segment of the record
	// they name, until the walk is past that segment.
	named map[int]map[mark]struct{}
	marks int // in named
	// dead holds the keys of the records walked past that are not kept:
	// an earlier record of such a key is replaced.
	dead map[messages.Key]struct{}
	// full: a live record did not fit in the budget; it and every live
	// record before it are trimmed.
	full bool
	// cut: dead and named held more than bound after a segment (held of
	// them), so the walk ends there.
	cut     bool
	held    int
	trimmed []tombstone // of the records trimmed, in write order
}

// The walk's bound on the keys and tombstones of dropped records it holds
// (walk.bound).
const (
	rebuildDroppedFloor   = 1 << 16
	rebuildDroppedPerKept = 4
)

// bound is how many keys of dropped records and tombstones (dead, named)
// the walk may hold after a segment before it ends there, as if the budget
// had filled: rebuildDroppedPerKept per record kept so far, and at least
// rebuildDroppedFloor (Config.droppedFloor and droppedPerKept in tests).
//
// Per record kept, since the records kept are what the budget holds: the
// budget gives no count of its own, as it counts data bytes and a record's
// data may be empty (a record is at least a 24-byte header on disk, which
// the budget does not count). A record kept holds an item, its LRU element,
// an index entry and its key; a dropped key or a tombstone an entry and a
// key, half of that or less: so the sets take at most about twice what the
// records kept take. The floor, some megabytes of keys, is for a walk that
// meets dropped records before the records it keeps. A directory the tier
// wrote with a full budget holds dropped records of half the budget again
// (dropDead's bound) plus a segment, each with a tombstone at most (those
// naming a deleted segment are not held), so with chunks of one size the
// sets reach about the records kept, well within the bound; it is passed
// where the newest records are nearly all dropped (many small chunks
// evicted for a few large ones, or most records dropped by Drop), past the
// floor.
//
// Ending early loses the live records of the older segments (a loss a
// cache may take) but brings back no record a tombstone names. A tombstone
// names a record written before it: the writer writes one only for a
// record indexed (after its write returned, or found by the rebuild), into
// the segment being written, whose id is the largest (ids only grow: the
// rebuild deletes only empty segments and those older than the ones it
// keeps, keeping the newest not empty, and the next segment's id is one
// more). So a tombstone in a segment left unread names a record in that
// segment or an older one, deleted unread too. Nor does a record in them
// replace one kept: a later record replaces an earlier one. So the walk
// keeps what it would keep of the segments it read were the older ones
// gone (tested so against rebuildAll).
func (w *walk) bound() int {
	floor, per := w.d.cfg.droppedFloor, w.d.cfg.droppedPerKept
	if floor <= 0 {
		floor = rebuildDroppedFloor
	}
	if per == 0 {
		per = rebuildDroppedPerKept
	}
	return max(floor, max(per, 0)*len(w.d.items))
}

// entry is an intact record or a tombstone read from a segment.
type entry struct {
	header
	at int64 // a record's data offset
}

// mark is the record a tombstone names in a segment: its key and data
// offset.
type mark struct {
	key string
	off int64
}

// segment walks seg's entries back from its last: a record is live unless
// a later record of its key or a later tombstone naming it was walked past,
// and a live record is kept while it fits in the budget with the later
// ones kept.
func (w *walk) segment(seg *segment) {
	d := w.d
	var trimmed []tombstone
	for j := len(w.entries) - 1; j >= 0; j-- {
		e := &w.entries[j]
		if e.tombstone {
			// A tombstone names a record written before it: one naming a
			// segment walked already names none (nor, if it names this
			// one, does it match a record walked already). Nor does one
			// naming a segment not in the directory (deleted with its
			// records): held, it would count against the bound to the
			// walk's end.
			if _, in := slices.BinarySearch(w.ids, e.seg); in && e.seg <= seg.id {
				m := w.named[e.seg]
				if m == nil {
					m = map[mark]struct{}{}
					w.named[e.seg] = m
				}
				if _, ok := m[mark{e.key, e.off}]; !ok {
					m[mark{e.key, e.off}] = struct{}{}
					w.marks++
				}
			}
			continue
		}
		key := messages.Key(e.key)
		if _, ok := d.items[key]; ok {
			continue // replaced by a later record, kept
		}
		if _, ok := w.dead[key]; ok {
			continue // replaced by a later record, not kept
		}
		if _, ok := w.named[seg.id][mark{e.key, e.at}]; ok {
			w.dead[key] = struct{}{} // dropped
			continue
		}
		if !w.full && e.size <= d.cfg.Bytes-d.used {
			d.indexOlder(&item{key: key, seg: seg, off: e.at, size: e.size, sum: e.sum})
			continue
		}
		w.full = true
		w.dead[key] = struct{}{}
		trimmed = append(trimmed, tombstone{key: key, seg: seg.id, off: e.at})
		d.evictions.Add(1)
	}
	slices.Reverse(trimmed)
	w.trimmed = trimmed
	d.rebuildHeld = max(d.rebuildHeld, len(d.items)+len(w.entries)+len(w.dead)+w.marks)
	for id, m := range w.named {
		if id >= seg.id { // walked past: no record left to name
			w.marks -= len(m)
			delete(w.named, id)
		}
	}
	if held := len(w.dead) + w.marks; !w.full && held > w.bound() {
		w.cut, w.held = true, held
	}
	clear(w.entries) // let the keys go
}

// read reads seg's intact records and tombstones into entries, in write
// order. A record that ends past the file or whose header fails its
// checksum is a torn write: the segment is cut there. A whole record whose
// data fails its checksum is skipped.
func (d *Disk) read(seg *segment, entries []entry) ([]entry, error) {
	r := &countReader{r: seg.f}
	for {
		start := r.n
		h, err := readHeader(r)
		if errors.Is(err, errEOF) {
			break
		}
		if err == nil && h.tombstone {
			entries = append(entries, entry{header: h})
			seg.marks += int64(h.len)
			continue
		}
		if err == nil {
			hash := crc32.New(castagnoli)
			_, err = io.CopyN(hash, r, h.size)
			if err == nil && hash.Sum32() != h.sum {
				d.discarded.Add(1) // bit rot in a whole record: skip it
				continue
			}
		}
		if err != nil { // torn: cut the tail
			d.discarded.Add(1)
			if terr := seg.f.Truncate(start); terr != nil {
				return entries, fmt.Errorf("disk: cut torn tail of %s: %w", seg.f.Name(), terr)
			}
			r.n = start
			break
		}
		entries = append(entries, entry{header: h, at: start + int64(h.len)})
	}
	seg.size = r.n
	return entries, nil
}

type countReader struct {
	r io.Reader
	n int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

package disk

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

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
// later one replaces, or a tombstone names). The walk stops with the
// segment where the budget fills up; every segment older than that holds
// no record kept, so it is deleted unread, as dropDead would delete it
// once read (its records are not counted as evictions, nor its torn or bad
// records as discarded). The records trimmed get tombstones, written once
// the writer starts; those of a deleted segment need none. The LRU order
// it starts with is write order (the order of use before the restart is
// not kept).
func (d *Disk) rebuild() error {
	ids, err := d.segmentIDs()
	if err != nil {
		return err
	}
	w := &walk{d: d, named: map[int]map[mark]struct{}{}, dead: map[messages.Key]struct{}{}}
	i := len(ids) - 1
	for ; i >= 0 && !w.full; i-- {
		// Read and cut; O_APPEND, so that a write lands at a segment's
		// end, not where the read left the offset (Open appends to the
		// newest where it holds no live chunk).
		f, err := d.openListed(d.segPath(ids[i]))
		if err != nil {
			return err
		}
		if f == nil {
			continue // no longer ours: left where it is, as the listing leaves it
		}
		seg := &segment{id: ids[i], f: f, out: d.outOf(f)}
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
			d.removeFile(f.Name(), true) // failed, it is read again at the next start
			continue
		}
		d.fileBytes += seg.size
		d.markBytes += seg.marks
		w.segment(seg)
	}
	for _, id := range ids[:i+1] {
		d.removeFile(d.segPath(id), true) // older than every record kept; failed, at the next start
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

// openListed opens a segment the listing showed as a regular file, for
// reading and cutting. Swapped since for a link, it is not followed (a cut
// would truncate whatever it points to), and swapped for anything but a
// regular file, it is not read: both are left alone as the listing leaves
// what is not ours (nil, no error).
func (d *Disk) openListed(path string) (*os.File, error) {
	if d.cfg.beforeOpen != nil {
		d.cfg.beforeOpen(path)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND|syscall.O_NOFOLLOW, 0)
	switch {
	case errors.Is(err, syscall.ELOOP) || errors.Is(err, syscall.EISDIR):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("disk: %w", err)
	}
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		_ = f.Close()
		if err != nil {
			return nil, fmt.Errorf("disk: %w", err)
		}
		return nil, nil
	}
	return f, nil
}

// walk is the rebuild's state as it walks back through the segments.
type walk struct {
	d       *Disk
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
	full    bool
	trimmed []tombstone // of the records trimmed, in write order
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
			// one, does it match a record walked already).
			if e.seg <= seg.id {
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
		if !w.full && e.size <= d.cfg.Bytes-d.used && int64(len(d.items)) < d.cfg.MaxChunks {
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
	clear(w.entries) // let the keys go
}

// read reads seg's intact records and tombstones into entries, in write
// order. A record that ends past the file or whose header fails its
// checksum is a torn write: the segment is cut there. A whole record whose
// data fails its checksum is skipped. A read that fails (EIO) is an error,
// and nothing is cut.
func (d *Disk) read(seg *segment, entries []entry) ([]entry, error) {
	r := &countReader{r: io.Reader(seg.f)}
	if d.cfg.readSegment != nil {
		r.r = d.cfg.readSegment(seg.f.Name(), seg.f)
	}
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
		if err != nil && r.err != nil {
			// The read failed, not the record: the bytes may be whole, so
			// they are not cut; the open fails instead (a restart reads
			// them again).
			return entries, fmt.Errorf("disk: read %s at offset %d: %w", seg.f.Name(), start, r.err)
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
	r   io.Reader
	n   int64
	err error // the first error but EOF: a failed read, not a short file
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && err != io.EOF && c.err == nil {
		c.err = err
	}
	return n, err
}

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

	"github.com/kvactors/kvactors/messages"
)

// rebuild indexes every intact record of every segment, in write order
// (which is the LRU order it starts with; the order of use before the
// restart is not kept), leaving out records a tombstone names, then trims
// to the budget (the trimmed get tombstones, written once the writer
// starts).
func (d *Disk) rebuild() error {
	entries, err := os.ReadDir(d.cfg.Dir)
	if err != nil {
		return fmt.Errorf("disk: %w", err)
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
	for _, id := range ids {
		// Open starts a new segment after the rebuild, so these are only
		// read and cut; O_APPEND all the same, so that a write to any
		// segment lands at its end, not where the scan left the offset.
		f, err := os.OpenFile(d.segPath(id), os.O_RDWR|os.O_APPEND, 0)
		if err != nil {
			return fmt.Errorf("disk: %w", err)
		}
		seg := &segment{id: id, f: f, out: f}
		d.segs = append(d.segs, seg)
		if err := d.scan(seg); err != nil {
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
	}
	for d.used > d.cfg.Bytes {
		d.evictFront()
	}
	d.dropDead()
	return nil
}

// scan indexes seg's records and unindexes those its tombstones name. A
// record that ends past the file or whose header fails its checksum is a
// torn write: the segment is cut there. A whole record whose data fails its
// checksum is skipped.
func (d *Disk) scan(seg *segment) error {
	r := &countReader{r: seg.f}
	for {
		start := r.n
		h, err := readHeader(r)
		if errors.Is(err, errEOF) {
			break
		}
		if err == nil && h.tombstone {
			if it, ok := d.items[messages.Key(h.key)]; ok && it.seg.id == h.seg && it.off == h.off {
				d.unindex(it)
			}
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
				return fmt.Errorf("disk: cut torn tail of %s: %w", seg.f.Name(), terr)
			}
			r.n = start
			break
		}
		key := messages.Key(h.key)
		if old, ok := d.items[key]; ok { // written again later: the later record wins
			d.unindex(old)
		}
		it := &item{key: key, seg: seg, off: start + int64(h.len), size: h.size, sum: h.sum}
		d.index(it)
	}
	seg.size = r.n
	return nil
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

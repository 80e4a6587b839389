package disk

import (
	"errors"
	"hash/crc32"
	"syscall"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// fullLogEvery bounds the lines a full filesystem logs: one per interval,
// however many writes find it full (each is counted: Stats.Full).
const fullLogEvery = time.Minute

// Spill queues a chunk evicted from host memory for writing; sum is its
// CRC-32C. It never blocks: a full queue or a closed disk drops the chunk
// (counted) and returns false. A chunk larger than the whole queue is taken
// when the queue is empty, so a model whose chunks are over QueueBytes still
// spills, one such chunk at a time: the spilled bytes held stay under
// max(QueueBytes, one chunk). A key longer than maxKeyLen is dropped
// (counted, logged once): no record could hold it. The writer checks data
// against sum before writing, so bytes that changed after the sum was taken
// are dropped too.
func (d *Disk) Spill(engine string, key messages.Key, sum uint32, data []byte) bool {
	if len(key) > maxKeyLen {
		d.dropped.Add(1)
		if !d.longKeyLogged.Swap(true) {
			d.cfg.Log.Warn("disk: chunks with keys longer than a record holds are not spilled",
				"key_bytes", len(key), "max_key_bytes", maxKeyLen, "engine", engine)
		}
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.items[key]; ok {
		return true
	}
	if !d.roomLocked(int64(len(data))) {
		d.dropped.Add(1)
		return false
	}
	select {
	case d.q <- spill{engine, key, sum, data}:
		d.queued += int64(len(data))
		return true
	default:
		d.dropped.Add(1)
		return false
	}
}

// Takes reports whether Spill would queue a chunk of n bytes now; when it
// would not (the queue full, the disk closed), the chunk is counted
// dropped as Spill counts it. The store asks before it copies a victim out
// of the pool, so a writer that is behind costs no copy that Spill would
// throw away; Spill checks again (the queue may fill in between).
func (d *Disk) Takes(n int64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.roomLocked(n) {
		d.dropped.Add(1)
		return false
	}
	return true
}

// roomLocked: the queue takes n more bytes (a chunk larger than
// QueueBytes goes into an empty queue) and a spill. Caller holds d.mu.
func (d *Disk) roomLocked(n int64) bool {
	return !d.closed && (d.queued == 0 || d.queued+n <= d.cfg.QueueBytes) && len(d.q) < cap(d.q)
}

// The writer appends a batch at a time: it takes a spill, then whatever else
// is already queued (it never waits for more), up to batchRecords records or
// batchBytes of data. The batch's records go to the segment with as few
// writes as it can: small records (header and data) are gathered in one
// buffer and written in one call; a large record's header ends the buffer's
// write and its data is written from the spill's own bytes (the copy would
// cost more than the call it saves). Measured in docs/BENCHMARKS.md.
const (
	batchBytes   = 256 << 10
	batchRecords = 256
	smallRecord  = 64 << 10
)

// writer is the one goroutine that appends records; its buffers are its own.
type writer struct {
	d       *Disk
	batch   []spill  // the spills taken
	run     []spill  // the batch's records bound for the current segment
	buf     []byte   // the records gathered for one write
	offs    []int64  // where each record of run has its data
	changes []change // the index's changes of a flush, in order
	// tombWait is how long after a failed tombstone write the retry comes:
	// TombstoneRetry, doubled per failure in a row up to a minute (each
	// failure that cannot be cut back retires a segment, and the retry
	// starts another file), back to TombstoneRetry after a success.
	tombWait time.Duration
}

// writer writes batches of spills and, after each (and when a drop wakes
// it), the tombstones of the records dropped meanwhile, so a restart brings
// back no record dropped more than a write before it. Closed, it writes
// what is queued, then the last tombstones.
func (d *Disk) writer() {
	defer close(d.done)
	w := &writer{d: d}
	w.writeTombstones() // of the records the rebuild trimmed to the budget
	for {
		select {
		case sp, ok := <-d.q:
			if !ok {
				w.writeTombstones()
				return
			}
			w.take(sp)
		case <-d.kick:
		}
		w.writeTombstones()
	}
}

// take writes a batch: sp and whatever else is queued already.
func (w *writer) take(sp spill) {
	d := w.d
	w.batch = append(w.batch[:0], sp)
	n := int64(len(sp.data))
gather:
	for len(w.batch) < batchRecords && n < batchBytes {
		select {
		case sp, ok := <-d.q:
			if !ok {
				break gather
			}
			w.batch = append(w.batch, sp)
			n += int64(len(sp.data))
		default:
			break gather
		}
	}
	w.write()
	clear(w.batch) // let the spilled bytes go
	d.mu.Lock()
	d.queued -= n
	d.mu.Unlock()
}

// writeTombstones appends the queued tombstones to the current segment (a
// new one where they would not fit, or where it is retired) in one write.
// A tombstone of a record whose segment is deleted is left out: nothing can
// bring that record back. A failed write is counted (Stats.Failed), the
// segment cut back (retired if that fails too), and the tombstones stay
// queued for the writer's next wake, TombstoneRetry later at the latest
// (a quiet tier would otherwise hold them until Close; doubled per failure
// in a row, up to a minute); they are as many
// as the index held at most.
func (w *writer) writeTombstones() {
	d := w.d
	d.mu.Lock()
	tombs := d.tombs
	d.tombs = nil
	oldest := d.segs[0].id
	seg := d.segs[len(d.segs)-1]
	d.mu.Unlock()
	buf := w.buf[:0]
	for _, t := range tombs {
		if t.seg >= oldest {
			buf = appendTombstone(buf, string(t.key), t.seg, t.off)
		}
	}
	w.buf = buf[:0]
	if len(buf) == 0 {
		return
	}
	requeue := func() {
		d.failed.Add(1)
		d.mu.Lock()
		d.tombs = append(d.tombs, tombs...)
		d.mu.Unlock()
		if w.tombWait == 0 {
			w.tombWait = d.cfg.TombstoneRetry
		}
		time.AfterFunc(w.tombWait, d.wakeWriter)
		w.tombWait = min(2*w.tombWait, max(time.Minute, d.cfg.TombstoneRetry))
	}
	n := int64(len(buf))
	if seg.retired || (seg.size > 0 && seg.size+n > d.cfg.SegmentBytes) {
		var err error
		if seg, err = w.roll(); err != nil {
			requeue()
			return
		}
	}
	if _, err := seg.out.Write(buf); err != nil {
		w.cutBack(seg)
		requeue()
		return
	}
	w.tombWait = 0
	d.mu.Lock()
	seg.size += n
	seg.marks += n
	d.fileBytes += n
	d.markBytes += n
	d.mu.Unlock()
}

// write appends the batch's records to the current segment (starting a new
// segment where the next record would not fit, or where the current one is
// retired) and indexes them. Only the writer calls it, so the current
// segment's size changes nowhere else.
func (w *writer) write() {
	d := w.d
	d.mu.Lock()
	seg := d.segs[len(d.segs)-1]
	d.mu.Unlock()
	end := seg.size // where the run ends
	w.run = w.run[:0]
	for _, sp := range w.batch {
		if crc32.Checksum(sp.data, castagnoli) != sp.sum {
			d.raced.Add(1) // the host bytes were reused before they were copied out
			continue
		}
		if int64(len(sp.data)) > d.cfg.Bytes || len(sp.key) > maxKeyLen { // Spill refuses a long key already
			d.dropped.Add(1)
			continue
		}
		rec := headerLen(sp.key) + int64(len(sp.data)) // what the record takes in the segment
		if seg.retired || (end > 0 && end+rec > d.cfg.SegmentBytes) {
			w.flush(seg)
			w.run = w.run[:0]
			var err error
			seg, err = w.roll()
			end = seg.size
			if err != nil {
				d.failed.Add(1)
				continue
			}
		}
		w.run = append(w.run, sp)
		end += rec
	}
	w.flush(seg)
	clear(w.run)
}

// roll starts a new segment and returns the current one: the new one, or
// where newSegment failed the one before.
func (w *writer) roll() (*segment, error) {
	d := w.d
	d.mu.Lock()
	defer d.mu.Unlock()
	err := d.newSegment()
	return d.segs[len(d.segs)-1], err
}

// cutBack cuts seg back to seg.size after a failed write, so it stays a
// run of whole records; if the cut fails too, seg is retired (counted):
// its file may run past seg.size, so later appends would not land where
// their offsets say.
func (w *writer) cutBack(seg *segment) {
	if seg.out.Truncate(seg.size) != nil {
		seg.retired = true
		w.d.retired.Add(1)
	}
}

// flush writes run's records at the end of seg, then indexes them (dropping
// least recently used chunks past the budget) and announces them stored. A
// failed write cuts the segment back to where the run began, so the
// segment stays a run of whole records; none of the run's records is
// indexed or announced. If the cut fails too, seg is retired (counted):
// its file may run past seg.size, so later appends would not land where
// their offsets say.
func (w *writer) flush(seg *segment) {
	if len(w.run) == 0 {
		return
	}
	d := w.d
	start := time.Now()
	pos, data, err := w.writeRun(seg)
	if err != nil {
		w.cutBack(seg)
		if isFull(err) {
			// A full filesystem (the files run past --disk-bytes by design:
			// headers, tombstones, dropped records up to half the budget,
			// the segment being written): nothing would be evicted or
			// deleted until a write succeeded, so every later spill would
			// fail too, and a restart would find the same files. The
			// oldest segment goes to make room, as the budget would have
			// it go, and the run is tried once more.
			d.full.Add(1)
			fullErr := err
			if !seg.retired && w.dropOldest() {
				if pos, data, err = w.writeRun(seg); err != nil {
					w.cutBack(seg)
				}
			}
			d.logFull(fullErr)
		}
	}
	if err != nil {
		d.failed.Add(int64(len(w.run)))
		return
	}
	d.writeNanos.Add(int64(time.Since(start)))
	d.writeBytes.Add(data)
	d.writes.Add(int64(len(w.run)))

	// The index's changes are told in the order they were made: a key in
	// the run twice whose first record the budget evicts before the second
	// is indexed ends told stored, as it is.
	changes := w.changes[:0]
	d.mu.Lock()
	d.fileBytes += pos - seg.size
	seg.size = pos
	for i, sp := range w.run {
		if old, ok := d.items[sp.key]; ok {
			d.unindex(old)
		}
		d.index(&item{key: sp.key, seg: seg, off: w.offs[i], size: int64(len(sp.data)), sum: sp.sum, engine: sp.engine})
		changes = append(changes, change{engine: sp.engine, key: sp.key, stored: true})
		for d.used > d.cfg.Bytes || int64(len(d.items)) > d.cfg.MaxChunks {
			changes = append(changes, removal(d.evictFront(), sp.engine))
		}
	}
	last := w.run[len(w.run)-1].engine
	for _, it := range d.dropDead() {
		changes = append(changes, removal(it, last))
	}
	// Told under the lock: a drop of one of these keys (a load that finds
	// it bad) cannot be told before its write (see Notify).
	d.tell(changes)
	d.mu.Unlock()
	clear(changes)
	w.changes = changes[:0]
}

// writeRun appends run's records to seg's file, and returns where the file
// ends if they all landed (w.offs: where each record's data starts) and
// the bytes of chunk data they hold.
func (w *writer) writeRun(seg *segment) (pos, data int64, err error) {
	buf, offs := w.buf[:0], w.offs[:0]
	pos = seg.size
	for _, sp := range w.run {
		data += int64(len(sp.data))
		h := len(buf)
		buf = appendHeader(buf, string(sp.key), int64(len(sp.data)), sp.sum)
		pos += int64(len(buf) - h)
		offs = append(offs, pos)
		pos += int64(len(sp.data))
		if len(sp.data) <= smallRecord {
			buf = append(buf, sp.data...)
			continue
		}
		if _, err = seg.out.Write(buf); err != nil {
			break
		}
		buf = buf[:0]
		if _, err = seg.out.Write(sp.data); err != nil {
			break
		}
	}
	if err == nil && len(buf) > 0 {
		_, err = seg.out.Write(buf)
	}
	w.buf, w.offs = buf[:0], offs
	return pos, data, err
}

// dropOldest deletes the oldest segment to make room on a full filesystem
// and announces its live chunks removed; false if there was none to delete
// (the segment being written is the only one) or its file would not go.
func (w *writer) dropOldest() bool {
	d := w.d
	d.mu.Lock()
	defer d.mu.Unlock()
	gone, ok := d.dropOldest()
	changes := w.changes[:0]
	for _, it := range gone {
		changes = append(changes, removal(it, w.run[0].engine))
	}
	d.tell(changes)
	clear(changes)
	w.changes = changes[:0]
	return ok
}

// logFull warns that a write found the filesystem full, at most once per
// fullLogEvery: the tier goes on, holding less than its budget, and the
// counter alone would show an operator watching the logs nothing.
func (d *Disk) logFull(err error) {
	if ok, _ := d.fullLog.Allow("full", d.cfg.now()); !ok {
		return
	}
	st := d.Stats()
	d.cfg.Log.Warn("disk: the filesystem is full: the tier deletes its oldest segment to make room and holds less "+
		"than --disk-bytes; size the filesystem at about 1.5 × --disk-bytes (docs/OPERATIONS.md)",
		"dir", d.cfg.Dir, "chunks", st.Chunks, "bytes", st.Bytes, "file_bytes", st.FileBytes,
		"budget_bytes", st.Budget, "full_writes", st.Full, "err", err)
}

// isFull reports whether a write failed for want of space: the filesystem
// full (ENOSPC) or the user's quota spent (EDQUOT).
func isFull(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}

// change is a key stored in or removed from the index, for engine.
type change struct {
	engine string
	key    messages.Key
	stored bool
}

// removal is it's removal, told to the engine that spilled it, or, for a
// chunk found at open (no engine known), to by: the engine whose action
// removed it.
func removal(it *item, by string) change {
	engine := it.engine
	if engine == "" {
		engine = by
	}
	return change{engine: engine, key: it.key}
}

// tell hands changes to Notify in their order, consecutive changes of one
// engine and kind in one call. Caller holds d.mu.
func (d *Disk) tell(changes []change) {
	for i := 0; i < len(changes); {
		first, keys := changes[i], []messages.Key(nil)
		for ; i < len(changes) && changes[i].engine == first.engine && changes[i].stored == first.stored; i++ {
			keys = append(keys, changes[i].key)
		}
		if first.stored {
			d.notify(first.engine, keys, nil)
		} else {
			d.notify(first.engine, nil, keys)
		}
	}
}
